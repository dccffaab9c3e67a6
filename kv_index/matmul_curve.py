"""A node's matmul time per decode step by batch size, as it registers it (``matmul_ms`` in its
registry HASH, kv_index/schema.py) and as the router's decode cost reads it.

Why the router needs it: on CPU a step's matmuls do not grow linearly with the batch. The BLAS
kernels the engine measured and chose (engine/models/cpu_linear.py) change at some row counts:
on the 2-core Xeon dev VM, SmolLM2-135M's matmuls take 43 ms at 3 rows and 64 ms at 4, then
70 ms at 8 and 83 ms at 16, and a whole decode step measured 69 ms at batch 3, 98 at 4, 114 at 8
and 162 at 16. A straight line through a colocated node's steps (batches 2-6, where the jump
is) then costs a sequence ~10 ms; through a disaggregated decode node's (batches 6-14), ~6
(the elastic benchmark's fits, docs/benchmarks.md). The planner fits the rest of a step (what
the matmuls leave) on a line and adds this curve back.

Wire form: ``"rows:ms,rows:ms,..."``, rows ascending (``""``: unknown, e.g. a GPU node).
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable

MatmulCurve = tuple[tuple[int, float], ...]  # (batch rows, milliseconds), rows ascending


def format_curve(points: Iterable[tuple[int, float]]) -> str:
    return ",".join(f"{r}:{ms:.3f}" for r, ms in points)


def parse_curve(text: str) -> MatmulCurve:
    """The curve of ``format_curve``'s text; () for "" or anything malformed (the curve is a
    refinement: a node whose entry cannot be read is fitted on a line as before)."""
    try:
        points = tuple((int(r), float(ms)) for r, ms in (p.split(":") for p in text.split(",") if p))
    except ValueError:
        return ()
    rows = [r for r, _ in points]
    if any(r < 1 for r in rows) or rows != sorted(set(rows)) or any(not ms >= 0 for _, ms in points):
        return ()
    return points


def curve_s(curve: MatmulCurve, batch: float) -> float:
    """Seconds of matmuls at ``batch`` rows: linear between measured rows, the last segment's
    line beyond the last (the first point's value below the first); 0 without a curve."""
    if not curve:
        return 0.0
    if len(curve) == 1 or batch <= curve[0][0]:
        return curve[0][1] / 1e3
    i = min(max(bisect.bisect_left(curve, batch, key=lambda p: p[0]), 1), len(curve) - 1)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return max(0.0, y0 + (y1 - y0) * (batch - x0) / (x1 - x0)) / 1e3
