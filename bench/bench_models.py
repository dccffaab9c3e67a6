"""The model a benchmark runs: a builtin name, a local directory, or ``tiny-<arch>``.

``tiny-<arch>`` builds a seeded random-weight model (engine/models/tiny.py) into a temporary
directory, so a benchmark's quick mode runs in tests without the real model's 13 s load.
"""
from __future__ import annotations

from pathlib import Path


def bench_model_dir(name: str, tmp: Path, progress=None, **tiny_overrides) -> Path:
    from engine.models.loader import resolve_source
    from engine.models.tiny import save_tiny_model

    if name.startswith("tiny-"):
        return save_tiny_model(tmp / name, arch=name.removeprefix("tiny-"), seed=0, **tiny_overrides)
    return resolve_source(name, progress=progress)
