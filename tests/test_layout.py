"""The layout's rules, checked on the import graph (../shared/docs/architecture.md, docs/map.md).

The graph is read statically from every module's source, imports inside functions included
(a lazy import still runs when that path is taken); only imports under ``if TYPE_CHECKING:``
are left out, since they never run. A rule names what a package must not *reach*: anything
imported by it, or by what it imports, transitively. A failure prints the chain of imports.
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("tokens", "engine", "kv_index", "kv_transfer", "node", "prefill_node", "decode_node", "router",
            "pdserve", "deploy", "protos", "telemetry", "security")
NODE_PACKAGES = ("node", "prefill_node", "decode_node")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    """Every first-party module (generated protobuf code included), by dotted name."""
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(tree: ast.AST) -> list[str]:
    """Dotted names this module imports when it runs, in order (``from a import b`` gives a.b,
    which is a module or a name in a)."""
    out: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
            out.extend(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


@cache
def edges(module: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """-> (first-party modules it imports, third-party top-level packages it imports).
    Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``."""
    mods = modules()
    first, third = [], []
    for name in _imported_names(ast.parse(mods[module].read_text(), str(mods[module]))):
        top = name.split(".")[0]
        if top not in PACKAGES:
            if top not in third:
                third.append(top)
            continue
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in mods and prefix != module and prefix not in first:
                first.append(prefix)
    return tuple(first), tuple(third)


def reach(module: str) -> dict[str, list[str]]:
    """Every module or third-party package ``module`` reaches -> one chain of imports to it."""
    chains: dict[str, list[str]] = {module: [module]}
    todo = [module]
    while todo:
        current = todo.pop()
        first, third = edges(current)
        for nxt in (*first, *third):
            if nxt not in chains:
                chains[nxt] = chains[current] + [nxt]
                if nxt in modules():
                    todo.append(nxt)
    return chains


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(packages: tuple[str, ...], forbidden: tuple[str, ...], exempt=lambda m: False) -> list[str]:
    """Chains from a module of ``packages`` to a module or third-party package in ``forbidden``."""
    out = []
    for module in modules():
        if not any(in_package(module, p) for p in packages) or exempt(module):
            continue
        for target, chain in reach(module).items():
            if any(in_package(target, f) or target.startswith(f) for f in forbidden):
                out.append(" -> ".join(chain))
    return out


def test_the_graph_is_read():
    # A sanity check of the reader itself on edges known to exist.
    assert "torch" in edges("engine.model_runner")[1]
    assert "tokens.block_hash" in edges("router.orchestrator")[0]
    lazy = reach("deploy.launcher")  # ray and the router are imported inside functions there
    assert "ray" in lazy and "router.server" in lazy
    assert "node.server" not in edges("node.actor")[0]  # only under TYPE_CHECKING


RULES = [
    # (packages, must not reach, why)
    (("router", "kv_index", "pdserve"), ("torch", "ray"), "the router and the SDK run without torch or Ray"),
    (("kv_index",), ("grpc",), "the index is Redis only"),
    (("pdserve",), ("engine", "node", "prefill_node", "decode_node", "router", "kv_index", "kv_transfer",
                    "deploy", "tokens", "redis", "security"), "the SDK is client code only"),
    (("engine",), ("grpc", "redis", "ray"), "the engine knows no sockets and no cluster"),
    (("tokens",), ("torch", "numpy", "grpc", "redis", "ray", "engine", "router", "node", "kv_index",
                   "kv_transfer", "protos"), "what every process shares is stdlib only"),
    (("kv_transfer",), ("router", *NODE_PACKAGES), "the transfer layer serves nodes, it does not know them"),
    (("node",), ("router", "prefill_node", "decode_node"), "the shared node runtime knows no role"),
    (("prefill_node",), ("decode_node",), "roles do not import each other"),
    (("decode_node",), ("prefill_node",), "roles do not import each other"),
    (("protos",), ("torch", "ray", "engine", "router", *NODE_PACKAGES), "the wire is importable anywhere"),
    (("telemetry",), ("torch", "ray", "grpc", "redis", "engine", "router", "kv_index", "kv_transfer", *NODE_PACKAGES),
     "metrics and tracing are shared by the torch-free router and the nodes, and know neither"),
    (("security",), ("torch", "ray", "redis", "numpy", "engine", "tokens", "router", "kv_index", "kv_transfer",
                     "protos", "telemetry", "deploy", "pdserve", *NODE_PACKAGES),
     "the security plumbing is shared by the router, the nodes and the launcher, and knows none of them"),
]


@pytest.mark.parametrize("packages, forbidden, why", RULES, ids=[" ".join(r[0]) for r in RULES])
def test_package_rule(packages, forbidden, why):
    bad = violations(packages, forbidden)
    assert not bad, f"{why}:\n" + "\n".join(bad)


def test_placement_is_pure():
    """Placement, admission and the cost model take plain data: no Redis, no gRPC."""
    pure = ("router.placement", "router.admission", "router.cost_model")
    bad = violations(pure, ("redis", "grpc"))
    assert not bad, "\n".join(bad)


def test_the_serving_path_never_imports_the_trace_replay():
    bad = violations(("router",), ("router.replay",), exempt=lambda m: in_package(m, "router.replay"))
    assert not bad, "\n".join(bad)


def test_every_module_is_in_the_docs():
    """docs/ list every module of every package (generated protobuf code excepted)."""
    docs = "\n".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    missing = [str(path.relative_to(REPO)) for name, path in modules().items()
               if path.name != "__init__.py" and not name.startswith("protos.pdserve")
               and str(path.relative_to(REPO)) not in docs]
    assert not missing, "not mentioned in docs/*.md: " + ", ".join(missing)
