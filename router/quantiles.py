"""Percentiles of a list of floats, stdlib only, so the torch-free router (router/replay/) and
every benchmark (bench/) read them the same way.

Three rules are in use, kept apart because they pick different values from the same data; for
the sorted values ``s`` of n numbers:

    percentile(values, p)     linear interpolation between closest ranks at (n - 1) * p / 100,
                              numpy's default; p in [0, 100]
    nearest_rank(values, q)   s[round(q * (n - 1))] (round half to even): numpy's "nearest";
                              q in [0, 1]
    upper_rank(values, q)     s[min(n - 1, floor(q * n))]: the smallest value with more than
                              a fraction q of the values at or below it; q in [0, 1]

    s = [1, 2, 3, 4]:  percentile(s, 50) = 2.5   nearest_rank(s, 0.5) = 3 (1.5 -> 2)
                       upper_rank(s, 0.5) = 3    upper_rank(s, 0.99) = 4

Each returns ``default`` (None unless given) for no values.
"""
from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], p: float, default: float | None = None) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    if not values:
        return default
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def nearest_rank(values: Sequence[float], q: float, default: float | None = None) -> float | None:
    """The value at rank ``round(q * (n - 1))``, clamped to the list."""
    if not values:
        return default
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def upper_rank(values: Sequence[float], q: float, default: float | None = None) -> float | None:
    """The value at rank ``floor(q * n)``, at most the last."""
    if not values:
        return default
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]
