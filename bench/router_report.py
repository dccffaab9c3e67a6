"""What `pdserve bench router` reports over seeds: one section per admission mode, each with
every policy's figures as a mean and 95% interval and the two comparisons the issue asks for.

  policy_result      ``pdserve_no_fetch`` against each peer: the same capabilities (no node
                     fetches from another), so the difference is the placement policy's.
  capability_result  ``pdserve`` (fetch on) against each peer given a shared tier at fetch's
                     bandwidth (``PEER+fetch``): the same capabilities again, fetch for all.

Ratios are pdserve's figure over the peer's, seed by seed (goodput: above 1 is pdserve ahead;
TTFT: below 1 is pdserve ahead), then the interval of the per-seed ratios.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from bench.router_stats import excludes, over_seeds, paired_ratios

# The peers the comparisons are made against: the published policies a router runs today that
# balance load (round robin and longest prefix stay in the tables as references).
PEERS = ("least_loaded", "sglang_cache_aware", "dynamo_kv", "llmd_weighted")
FETCH = "+fetch"
FETCH_PEERS = tuple(p + FETCH for p in PEERS)
HEADLINE_METRIC = "goodput_rps"
METRICS = ("goodput_rps", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "hit_ratio", "hit_vs_global_pool", "imbalance",
           "rejected", "slo_attainment")
RATIO_METRICS = ("goodput_rps", "ttft_mean_s", "ttft_p99_s")
# admission mode -> the JSON field it is reported under, headline first
SECTIONS = {"none": "headline", "queue_bound": "gated", "pdserve_model": "gated_by_pdserve_model"}
NOTES = {
    "none": "no admission: every policy serves every request (TTFT over the same requests)",
    "queue_bound": "one policy-neutral gate: a request whose true queue wait on the node its policy chose "
                   "exceeds its TTFT budget (x gate_queue_fraction) is rejected, for every policy alike",
    "pdserve_model": "secondary: pdserve's cost model judges every policy's choice (its estimate of the chosen "
                     "pair against the SLO); it favours pdserve, whose choices are made by that model",
}


def section(mode: str, tables: Sequence[Mapping[str, Mapping]]) -> dict:
    """One admission mode's figures over the per-seed tables (policy -> summary)."""
    return {
        "admission": mode,
        "note": NOTES[mode],
        "metric": HEADLINE_METRIC,
        "policies": over_seeds(tables, METRICS),
        "policy_result": _comparison(tables, "pdserve_no_fetch", {p: p for p in PEERS}),
        "capability_result": _comparison(tables, "pdserve", {p: p + FETCH for p in PEERS}),
    }


def _comparison(tables, num: str, dens: Mapping[str, str]) -> dict:
    """num's figures over each den's, per RATIO_METRICS (keyed by the peer's base name)."""
    out = {}
    for metric in RATIO_METRICS:
        ratios = paired_ratios(tables, num, list(dens.values()), metric)
        for peer, den in dens.items():
            if den in ratios:
                out.setdefault(peer, {"against": den})[metric] = ratios[den]
    return {"pdserve": num, "ratios": out}


def print_section(report, key: str, sec: Mapping) -> None:
    """Every policy's figures as mean [lo, hi], then the two comparisons."""
    report.progress(f"{key} ({sec['admission']}): {sec['note']}")
    cols = ("goodput_rps", "ttft_mean_s", "ttft_p99_s", "hit_ratio", "rejected")
    report.table(["policy", *cols],
                 [[name, *[fmt(figs[c]) for c in cols]] for name, figs in sec["policies"].items()])
    for result in ("policy_result", "capability_result"):
        comp = sec[result]
        rows = [[f"{comp['pdserve']} / {r['against']}", *[fmt(r[m], ratio=True) for m in RATIO_METRICS if m in r]]
                for r in comp["ratios"].values()]
        if rows:
            report.table([result, *[f"{m} ratio" for m in RATIO_METRICS]], rows)


def fmt(iv: Mapping, ratio: bool = False) -> str:
    """'mean [lo, hi]', and a mark on a ratio whose interval excludes 1."""
    if iv["n"] == 0:
        return "-"
    digits = 4 if ratio or abs(iv["mean"]) < 10 else 2
    text = f"{iv['mean']:.{digits}f}"
    if not math.isnan(iv["lo"]):
        text += f" [{iv['lo']:.{digits}f}, {iv['hi']:.{digits}f}]"
    if ratio and excludes(iv, 1.0):
        text += " *"
    return text
