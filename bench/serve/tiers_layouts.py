"""The layouts `bench serve --compare tiers` runs, the order it runs them in, and what it
reports about them: plain data, no cluster.

Layouts (one prefill + one decode node each; ``off`` is the baseline every ratio divides by)::

    off        device pools only, no host or disk tier, no prefix fetch
    off-local  off, and a decode node that holds all but a few of a follow-up turn's tokens
               prefills them itself (Dynamo's local prefill by uncached length)
    off-big    off, with each device pool enlarged by the RAM the host tier would take
    tiers      host and disk tiers, no prefix fetch
    fetch      prefix fetch, no tiers
    on         tiers and fetch

The order is A B ... then ... B A for each seed, so drift over the run (a warming page cache,
a neighbour's load) falls on every layout alike; the baseline's first and last runs of the
first seed are an A/A pair: the spread a ratio must beat to mean anything.

Headline: SLO attainment and TTFT percentiles. The turns of a conversation are closed-loop
(the next is sent a think time after the answer), so a faster layout also finishes sooner and
goodput (good requests per second of run) counts its win twice; it is reported, named as such.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

BASELINE = "off"


@dataclass(frozen=True, slots=True)
class TiersLayout:
    name: str
    tiers: bool = False  # host and disk tiers
    fetch: bool = False  # prefix fetch between nodes
    local_uncached: bool = False  # local prefill by uncached length
    device_plus_host: bool = False  # the device pool gets the host tier's RAM


LAYOUTS = {lay.name: lay for lay in (
    TiersLayout("off"),
    TiersLayout("off-local", local_uncached=True),
    TiersLayout("off-big", device_plus_host=True),
    TiersLayout("tiers", tiers=True),
    TiersLayout("fetch", fetch=True),
    TiersLayout("on", tiers=True, fetch=True),
)}


def parse_layouts(text: str) -> list[TiersLayout]:
    """``off,on`` -> the layouts, the baseline first (added when missing: every ratio needs it)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown tiers layout(s) {unknown}: choose from {sorted(LAYOUTS)}")
    names = [BASELINE] + [n for n in dict.fromkeys(names) if n != BASELINE]
    return [LAYOUTS[n] for n in names]


def schedule(layouts: list[str], seeds: list[int], abba: bool) -> list[tuple[str, int]]:
    """(layout, seed) in run order: per seed A B C, then C B A with ``abba``."""
    out = []
    for seed in seeds:
        out += [(n, seed) for n in layouts]
        if abba:
            out += [(n, seed) for n in reversed(layouts)]
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _ratio(a, b):
    return a / b if a is not None and b else None


HIGHER = ("slo_attainment", "goodput_rps")  # a layout's figure over the baseline's
LOWER = ("ttft_p50", "ttft_p99")  # the baseline's over the layout's: above 1 is better either way


def figures(summary: dict) -> dict:
    """The figures a ratio is taken of, from one run's summary."""
    return {"slo_attainment": summary.get("slo_attainment"), "goodput_rps": summary.get("goodput_rps"),
            "ttft_p50": summary["ttft_s"]["p50"], "ttft_p99": summary["ttft_s"]["p99"],
            "cached_token_fraction": summary["cached_token_fraction"], "failed": summary["failed"]}


def ratios(layout: dict, base: dict) -> dict:
    """Per figure, better-is-above-1 ratios of one layout's figures against the baseline's."""
    out = {f"{k}_ratio": _ratio(layout[k], base[k]) for k in HIGHER}
    out.update({f"{k}_ratio": _ratio(base[k], layout[k]) for k in LOWER})
    return out


def compare(runs: list[dict]) -> dict:
    """``runs``: [{"layout", "seed", "figures"}] in run order. Per layout: its figures averaged
    over its runs of each seed, and the ratios against the baseline's of the same seed,
    averaged over seeds with the spread (min, max) across them; the A/A pair (the baseline's
    first two runs of one seed) as the same ratios."""
    seeds = sorted({r["seed"] for r in runs})
    layouts = list(dict.fromkeys(r["layout"] for r in runs))
    per = {}
    for lay in layouts:
        for seed in seeds:
            mine = [r["figures"] for r in runs if r["layout"] == lay and r["seed"] == seed]
            if mine:
                per[lay, seed] = {k: _mean([m[k] for m in mine]) for k in mine[0]}
    out = {}
    for lay in layouts:
        by_seed = [ratios(per[lay, s], per[BASELINE, s]) for s in seeds if (lay, s) in per and (BASELINE, s) in per]
        entry = {"runs": sum(r["layout"] == lay for r in runs),
                 "figures": {k: _mean([per[lay, s][k] for s in seeds if (lay, s) in per])
                             for k in next(iter(per.values()))}}
        for key in (by_seed[0] if by_seed else {}):
            vals = [r[key] for r in by_seed if r[key] is not None]
            entry[key] = _mean(vals)
            entry[f"{key}_range"] = [min(vals), max(vals)] if vals else None
        out[lay] = entry
    return {"layouts": out, "aa": aa_pair(runs)}


def aa_pair(runs: list[dict]) -> dict | None:
    """The baseline's first two runs of the first seed that has two: the same layout, seed
    and requests, so their ratios (about 1) are the noise a layout's ratio must clear."""
    for seed in dict.fromkeys(r["seed"] for r in runs):
        mine = [r["figures"] for r in runs if r["layout"] == BASELINE and r["seed"] == seed]
        if len(mine) >= 2:
            return {"seed": seed, **ratios(mine[1], mine[0])}
    return None
