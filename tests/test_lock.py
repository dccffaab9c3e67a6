"""requirements/lock.txt is what a fresh machine installs: it agrees with pyproject.toml, it pins
everything exactly, and this environment (the one the tests run in) is what it says."""
from __future__ import annotations

import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements/lock.txt"
NODEPS = ROOT / "requirements/nodeps.lock"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def _pins(path: Path) -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _PIN.match(line)
        assert match, f"{path.name}: not an exact pin: {raw!r}"
        pins[canonicalize_name(match.group(1))] = Version(match.group(2))
    return pins


def _direct_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": "dev"})]


def _disagreements(requirements: list[Requirement], pins: dict[str, Version]) -> list[str]:
    problems = []
    for req in requirements:
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            problems.append(f"{req.name}: in pyproject.toml, not in the lock")
        elif not req.specifier.contains(pin, prereleases=True):
            problems.append(f"{req.name}: pyproject.toml wants {req.specifier}, the lock has {pin}")
    return problems


def test_every_line_of_the_lock_is_an_exact_pin() -> None:
    assert len(_pins(LOCK)) > 50 and _pins(NODEPS)


def test_pyproject_and_the_lock_agree() -> None:
    assert _disagreements(_direct_requirements(), _pins(LOCK)) == [], "run `make lock`"


def test_a_disagreement_is_caught() -> None:
    pins = dict(_pins(LOCK))
    moved = Requirement("grpcio-tools==9.0.0")
    assert _disagreements([moved], pins) == [f"grpcio-tools: pyproject.toml wants ==9.0.0, the lock has {pins['grpcio-tools']}"]
    del pins["redis"]
    assert _disagreements([Requirement("redis>=5.0")], pins) == ["redis: in pyproject.toml, not in the lock"]


def test_torch_is_locked_at_the_release_installed_first() -> None:
    # scripts/setup.sh installs torch==2.13.0 before the lock; the lock must not ask for another.
    torch = _pins(LOCK)["torch"]
    assert torch.public == "2.13.0"


def test_this_environment_is_what_the_lock_says() -> None:
    # What CI tested is what a fresh machine gets: the venv the tests run in matches every pin.
    drifted = []
    for name, pin in {**_pins(LOCK), **_pins(NODEPS)}.items():
        try:
            installed = Version(version(name))
        except PackageNotFoundError:
            drifted.append(f"{name}: locked {pin}, not installed")
            continue
        if installed != pin:
            drifted.append(f"{name}: locked {pin}, installed {installed}")
    assert drifted == [], "run `make setup` (scripts/setup.sh installs from the lock)"
