"""The one way a benchmark draws a PNG: ``with figure(path, ...) as (fig, axes): ...draw...``.

matplotlib is imported here, lazily, on the Agg backend (no display on servers and CI), so a
benchmark run without a plot never pays for it. Leaving the block lays the figure out and saves
it; the figure is closed whether or not drawing succeeded, so a long run that plots many times
keeps no figure alive (pyplot holds every open one).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def figure(path: str | Path, *, dpi: float | None = None, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """``(fig, axes)`` from ``plt.subplots(**subplots)``; on a normal exit, ``tight_layout`` and
    the PNG saved at ``path`` (``dpi`` None: matplotlib's default, 100). Nothing is saved when
    the block raises."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(**subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
