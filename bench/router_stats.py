"""Mean and 95% interval over seeds, for `pdserve bench router --seeds ...`.

Pure functions over plain numbers: ``interval`` (Student's t over the per-seed values),
``over_seeds`` (every policy's figures), ``paired_ratios`` (one policy's figure over another's,
seed by seed, so the node order and the noise a seed draws cancel in each ratio before the
interval is taken).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

# Two-sided 95% critical values of Student's t by degrees of freedom (df > 30: the normal's).
_T975 = (math.nan, 12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052,
         2.048, 2.045, 2.042)
_Z975 = 1.960


def t_critical(df: int) -> float:
    """The t value that leaves 2.5% in each tail with ``df`` degrees of freedom."""
    if df < 1:
        return math.nan
    return _T975[df] if df < len(_T975) else _Z975


def interval(values: Sequence[float]) -> dict:
    """Mean and the 95% t-interval of the mean of ``values`` (one per seed). One value has no
    interval (lo, hi are nan); NaN values are left out and counted."""
    xs = [float(v) for v in values if not math.isnan(v)]
    n = len(xs)
    out = {"mean": math.nan, "lo": math.nan, "hi": math.nan, "n": n, "dropped_nan": len(values) - n,
           "values": list(xs)}
    if n == 0:
        return out
    mean = sum(xs) / n
    out["mean"] = mean
    if n > 1:
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
        half = t_critical(n - 1) * sd / math.sqrt(n)
        out["lo"], out["hi"] = mean - half, mean + half
    return out


def over_seeds(tables: Sequence[Mapping[str, Mapping]], metrics: Sequence[str]) -> dict[str, dict[str, dict]]:
    """policy -> metric -> ``interval`` over the per-seed tables (policy -> summary), for the
    policies every table has (a metric a summary lacks counts as nan)."""
    names = [n for n in tables[0] if all(n in t for t in tables)] if tables else []
    return {n: {m: interval([t[n].get(m, math.nan) for t in tables]) for m in metrics} for n in names}


def paired_ratios(tables: Sequence[Mapping[str, Mapping]], num: str, dens: Sequence[str],
                  metric: str) -> dict[str, dict]:
    """den -> ``interval`` of num's ``metric`` / den's, taken seed by seed; a den some table
    lacks is skipped."""
    out = {}
    for den in dens:
        if not all(num in t and den in t for t in tables) or not tables:
            continue
        out[den] = interval([_ratio(t[num][metric], t[den][metric]) for t in tables])
    return out


def excludes(iv: Mapping, value: float) -> bool:
    """The interval lies wholly on one side of ``value`` (the difference is resolved)."""
    return not math.isnan(iv["lo"]) and (iv["lo"] > value or iv["hi"] < value)


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan
