"""The layout's rules, checked on the import graph (../shared/docs/architecture.md, docs/map.md).

The graph is read statically from every module's source, imports inside functions included
(a lazy import still runs when that path is taken); only imports under ``if TYPE_CHECKING:``
are left out, since they never run.

The rules are the Packages table of docs/map.md, read here, so the table cannot drift from the
code. Per package row:

- "may import" is exact: what the row's modules import *directly* from other first-party
  packages and from third-party packages is what the cell names, no more (an import the cell
  does not allow fails) and no less (a name no module of the row imports is stale and fails).
  The standard library is always allowed. "`node` and what it imports" allows what the `node/`
  row allows, without requiring it; "everything" (`deploy/`) is not checked.
- "must not reach" is transitive: nothing imported by the package, or by what that imports,
  may be (or be inside) a name of the cell. A failure prints the chain of imports.

A cell is a list split at commas and semicolons; text in parentheses is a comment (the why);
a name in backticks is a first-party package or module (`kv_index.events`, `router/replay/`),
a bare name a third-party one as Python imports it (`google.protobuf`, not protobuf). Phrases:
"the standard library", "everything", "`X` and what it imports", "each other" (the other
packages of a row naming several), "every other first-party package".
"""
from __future__ import annotations

import ast
import re
import sys
from functools import cache
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parent.parent
MAP = REPO / "docs" / "map.md"
PACKAGES = ("tokens", "engine", "kv_index", "kv_transfer", "node", "prefill_node", "decode_node", "router",
            "tool_calling", "frontend", "pdserve", "deploy", "bench", "chaos", "protos", "telemetry", "security",
            "settings")


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
    assert "tokens.block_hash" in edges("router.prepare")[0]
    lazy = reach("deploy.launcher")  # ray and the router are imported inside functions there
    assert "ray" in lazy and "frontend.server" in lazy
    assert "node.server" not in edges("node.actor")[0]  # only under TYPE_CHECKING


# ----------------------------------------------------------------------------- docs/map.md's table
class Row(NamedTuple):
    """One row of the Packages table: the packages it is about and its two rule cells as written."""

    packages: tuple[str, ...]
    may_import: str
    must_not_reach: str

    @property
    def name(self) -> str:
        return ", ".join(f"`{p}/`" for p in self.packages)


class Names(NamedTuple):
    """What a cell names: first-party packages or modules, third-party import names."""

    first: frozenset[str] = frozenset()
    third: frozenset[str] = frozenset()
    anything: bool = False

    def __or__(self, other: Names) -> Names:
        return Names(self.first | other.first, self.third | other.third, self.anything or other.anything)

    def covers(self, name: str) -> bool:
        """Whether ``name`` (a module or a dotted third-party name) is, or is inside, a named one.
        A first-party name may also be a package above a named module: importing
        ``kv_index.events`` runs ``kv_index/__init__.py``."""
        if self.anything:
            return True
        if name.split(".")[0] in PACKAGES:
            return any(in_package(name, f) or f.startswith(name + ".") for f in self.first)
        return any(name == t or name.startswith(t + ".") for t in self.third)


@cache
def package_table() -> dict[str, Row]:
    """docs/map.md's Packages table by package (a row naming two packages is under both);
    rows that are not Python (``helm/``) are left out."""
    section = MAP.read_text().split("\n## Packages\n", 1)[1].split("\n#", 1)[0]
    rows: dict[str, Row] = {}
    for line in section.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "package" or "(not Python)" in cells[0]:
            continue
        row = Row(tuple(_dotted(n) for n in re.findall(r"`([^`]+)`", cells[0])), cells[2], cells[3])
        rows.update(dict.fromkeys(row.packages, row))
    return rows


def _dotted(name: str) -> str:
    return name.strip("/").replace("/", ".")


def _items(cell: str) -> list[str]:
    """A cell's items: split at commas and semicolons, comments in parentheses dropped."""
    return [i.strip() for i in re.split(r"[,;]", re.sub(r"\([^)]*\)", "", cell)) if i.strip()]


def _name(item: str, row: Row, column: str) -> Names:
    """One plain item: a first-party name in backticks or a bare third-party import name."""
    if m := re.fullmatch(r"`([\w./]+)`", item):
        name = _dotted(m.group(1))
        if name.split(".")[0] not in PACKAGES:
            raise ValueError(f"docs/map.md, {column!r} of {row.name}: `{name}` is no first-party package")
        return Names(first=frozenset({name}))
    if re.fullmatch(r"[A-Za-z_][\w.]*", item):
        return Names(third=frozenset({item}))
    raise ValueError(f"docs/map.md, {column!r} of {row.name}: cannot read {item!r}")


def may_import(package: str) -> tuple[Names, Names]:
    """(what the row's "may import" cell allows, the names it lists itself: each must be used)."""
    row = package_table()[package]
    allowed = listed = Names()
    for item in _items(row.may_import):
        if item == "the standard library":
            pass
        elif item == "everything":
            allowed |= Names(anything=True)
        elif m := re.fullmatch(r"(`\w+`) and what it imports", item):
            named = _name(m.group(1), row, "may import")
            listed |= named
            allowed |= named | may_import(next(iter(named.first)))[0]
        else:
            named = _name(item, row, "may import")
            listed |= named
            allowed |= named
    return allowed, listed


def must_not_reach(package: str) -> Names:
    """What the row's "must not reach" cell forbids ``package``."""
    row = package_table()[package]
    out = Names()
    for item in _items(row.must_not_reach):
        if item == "each other":
            out |= Names(first=frozenset(set(row.packages) - {package}))
        elif item == "every other first-party package":
            out |= Names(first=frozenset(set(PACKAGES) - set(row.packages)))
        else:
            out |= _name(item, row, "must not reach")
    return out


@cache
def direct_imports(package: str) -> frozenset[tuple[str, str]]:
    """(module, name) for each import a module of ``package`` makes outside it: first-party ones
    as the modules they run, third-party ones as written; the standard library left out."""
    out: set[tuple[str, str]] = set()
    for module, path in modules().items():
        if not in_package(module, package):
            continue
        out.update((module, t) for t in edges(module)[0] if not in_package(t, package))
        for name in _imported_names(ast.parse(path.read_text(), str(path))):
            top = name.split(".")[0]
            if top not in PACKAGES and top not in sys.stdlib_module_names:
                out.add((module, name))
    return frozenset(out)


def test_the_table_has_a_row_per_package():
    assert sorted(package_table()) == sorted(PACKAGES), "docs/map.md's Packages table against PACKAGES"


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_are_in_the_may_import_column(package):
    allowed, _ = may_import(package)
    refused = {(module, name) for module, name in direct_imports(package) if not allowed.covers(name)}
    # Importing a.b also runs a/__init__: name the deepest module only.
    bad = sorted(f"{m} imports {n}" for m, n in refused
                 if not any(m == m2 and n2.startswith(n + ".") for m2, n2 in refused))
    row = package_table()[package]
    assert not bad, (f"not allowed by the 'may import' cell of {row.name} in docs/map.md "
                     f"({row.may_import!r}):\n" + "\n".join(bad))


def test_the_may_import_column_names_only_what_is_imported():
    stale = []
    for row in dict.fromkeys(package_table().values()):
        imported = {name for p in row.packages for _, name in direct_imports(p)}
        listed = Names()
        for p in row.packages:
            listed |= may_import(p)[1]
        for name in sorted(listed.first | listed.third):
            if not any(i == name or i.startswith(name + ".") for i in imported):
                stale.append(f"{row.name}: {name!r} ({row.may_import!r})")
    assert not stale, ("named in a 'may import' cell of docs/map.md, imported by no module of its row:\n"
                       + "\n".join(stale))


@pytest.mark.parametrize("package", PACKAGES)
def test_package_rule(package):
    forbidden = must_not_reach(package)
    bad = violations((package,), tuple(sorted(forbidden.first | forbidden.third)))
    row = package_table()[package]
    assert not bad, (f"the 'must not reach' cell of {row.name} in docs/map.md ({row.must_not_reach!r}) forbids "
                     "the end of each chain:\n" + "\n".join(bad))


def test_placement_is_pure():
    """Placement, admission and the cost model take plain data: no Redis, no gRPC."""
    pure = ("router.placement", "router.admission", "router.cost_model")
    bad = violations(pure, ("redis", "grpc"))
    assert not bad, "\n".join(bad)


def test_the_serving_path_never_imports_the_trace_replay():
    bad = violations(("router", "frontend"), ("router.replay",), exempt=lambda m: in_package(m, "router.replay"))
    assert not bad, "\n".join(bad)


def test_only_the_cli_reaches_benchmarks_and_chaos():
    """What deploys (the launcher, `pdserve nodes`, the pool controller) carries no benchmark and
    no fault injector: of `deploy/`, only the CLI that dispatches `pdserve bench` and `pdserve
    chaos` reaches `bench/` or `chaos/`."""
    bad = violations(("deploy",), ("bench", "chaos"), exempt=lambda m: m == "deploy.cli")
    assert not bad, "\n".join(bad)


def test_every_module_is_in_the_docs():
    """docs/ list every module of every package (generated protobuf code excepted)."""
    docs = "\n".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    missing = [str(path.relative_to(REPO)) for name, path in modules().items()
               if path.name != "__init__.py" and not name.startswith("protos.pdserve")
               and str(path.relative_to(REPO)) not in docs]
    assert not missing, "not mentioned in docs/*.md: " + ", ".join(missing)
