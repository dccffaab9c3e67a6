"""Pyflakes (unused or undefined names) and import order on the whole tree, as configured in
pyproject.toml's [tool.ruff]; `ruff check --fix .` repairs most of what this reports."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the dev extra)")
    out = subprocess.run([ruff, "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
