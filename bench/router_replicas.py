"""`pdserve bench router --trace PATH --routers 2,4`: placement quality with several router
replicas against one, on the replay (router/replay/simulator.py, ``routers`` and ``share_s``).

Each request reaches one of N replicas at random (SO_REUSEPORT spreads connections, not load);
each replica has its own ledger of the prefill seconds it placed per node, and sees the others'
only as often as the live router does: every ``--share-s`` (the node view's refresh, 0.5 s by
default), through the records router/replicas.py publishes. Two variants per N:

  shared     the replicas read each other's ledgers every ``share_s`` (what pdserve runs)
  unshared   each sees only its own ledger and the nodes' heartbeats (the negative control:
             the replicas pile onto the node that looks idle to each)

Policy ``pdserve`` (the live router's TtftPolicy, fetch on) at N = 1 is the baseline. Per seed,
each variant's goodput, mean and p99 TTFT over the 1-router figure, then the mean and 95%
t-interval over the seeds (bench/router_stats.py). The check: ``shared`` at 2 replicas keeps
goodput within ``GOODPUT_FLOOR_2`` of one router, and ``shared`` beats ``unshared`` at the
largest N (if sharing changed nothing, the figure would be blind to it).

``--spread-arrivals S``: every arrival moved by a uniform draw within S seconds of trace time
(the traces' 3 s stamps: ``spread_arrivals``), for every variant alike, the one router's too.
"""
from __future__ import annotations

import argparse
import math
import random
from dataclasses import replace

from bench.router_stats import interval, paired_ratios

POLICY = "pdserve"
RATIO_METRICS = ("goodput_rps", "ttft_mean_s", "ttft_p99_s")
# Shared replicas lose at most this much goodput at N = 2 against one router (the staleness of
# one refresh costs a few misplaced requests, not a pile-up).
GOODPUT_FLOOR_2 = 0.95


def spread_arrivals(requests: list, width_s: float, seed: int = 0) -> list:
    """Each arrival moved by a uniform draw in [0, ``width_s``) of trace time, then sorted: the
    Mooncake traces stamp arrivals in 3 s buckets (about ten requests at one instant), which
    no router replica could tell apart however often it shares its ledger; one router serializes
    them with its ledger exact between each. The same draw for every variant (``seed``)."""
    if width_s <= 0:
        return list(requests)
    rng = random.Random(f"spread-{seed}")
    moved = [replace(r, arrival_s=r.arrival_s + rng.random() * width_s) for r in requests]
    return sorted(moved, key=lambda r: r.arrival_s)


def router_counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(x) for x in text.split(",") if x.strip())
    if not counts or any(n < 2 for n in counts) or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"want distinct comma-separated replica counts >= 2, got {text!r}")
    return counts


def compare_replicas(replay, mode: str, seeds, counts: tuple[int, ...], share_s: float, report) -> dict:
    """Every seed: one router, then each N shared and unshared; the ratios over the seeds."""
    tables = []
    for seed in seeds:
        table = {"1": replay(POLICY, mode, seed).summary()}
        for n in counts:
            table[f"{n}_shared"] = replay(POLICY, mode, seed, routers=n, share_s=share_s).summary()
            table[f"{n}_unshared"] = replay(POLICY, mode, seed, routers=n, share_s=None).summary()
        tables.append(table)
    out: dict = {"policy": POLICY, "admission": mode, "share_s": share_s, "routers": list(counts),
                 "figures": {k: {m: interval([t[k][m] for t in tables]) for m in (*RATIO_METRICS, "hit_ratio")}
                             for k in tables[0]},
                 "ratios": {}}
    for key in tables[0]:
        if key == "1":
            continue
        # paired_ratios gives num / den; the variant is the numerator, one router the denominator.
        out["ratios"][key] = {m: paired_ratios(tables, key, ["1"], m)["1"] for m in RATIO_METRICS}
    top = max(counts)
    two = out["ratios"].get("2_shared")
    shared, unshared = out["ratios"][f"{top}_shared"]["goodput_rps"], out["ratios"][f"{top}_unshared"]["goodput_rps"]
    out["check"] = {
        "goodput_2_shared_vs_1": two["goodput_rps"]["mean"] if two else None,
        "goodput_2_within_floor": (two["goodput_rps"]["mean"] >= GOODPUT_FLOOR_2) if two else None,
        "floor": GOODPUT_FLOOR_2,
        f"shared_beats_unshared_at_{top}": shared["mean"] > unshared["mean"],
    }
    out["passed"] = all(v for k, v in out["check"].items() if isinstance(v, bool))
    _print(report, out)
    return out


def _print(report, out: dict) -> None:
    report.progress(f"router replicas ({out['policy']}, admission {out['admission']}, shared every "
                    f"{out['share_s']} s): each figure over one router's, per seed")
    rows = []
    for key, ratios in out["ratios"].items():
        rows.append([key, *[_fmt(ratios[m]) for m in RATIO_METRICS]])
    report.table(["replicas", *[f"{m} / 1 router" for m in RATIO_METRICS]], rows)
    report.progress(f"check: {out['check']} -> {'pass' if out['passed'] else 'FAIL'}")


def _fmt(iv: dict) -> str:
    if iv["n"] == 0:
        return "-"
    text = f"{iv['mean']:.3f}"
    if not math.isnan(iv["lo"]):
        text += f" [{iv['lo']:.3f}, {iv['hi']:.3f}]"
    return text
