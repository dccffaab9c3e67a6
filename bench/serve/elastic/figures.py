"""The pure parts of `pdserve bench serve --compare elastic`: the interleaved schedule, what
counts as dropped, role switches from registry samples, and the summary arithmetic.

Plain data in, plain data out (``serve_metrics.Record`` lists, dicts of figures): tested
without a cluster in tests/test_bench_elastic.py.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from bench.serve.metrics import Record, Slo

# The layouts, in the order the first pass runs them.
FIXED, COLOCATED, ELASTIC = "fixed", "colocated", "elastic"
STATIC = (FIXED, COLOCATED)

# The errors a router answers on purpose, with a reason, before a request runs (overload,
# admission, a request it cannot serve). Everything else that did not complete was lost.
REFUSED_ERRORS = ("ResourceExhaustedError", "InvalidRequestError")

TARGETS = {"elastic_vs_best_static_min": 0.95, "elastic_vs_best_static_phases": 1.3, "dropped": 0}


def schedule(layouts: Sequence[str]) -> list[tuple[int, str]]:
    """(pass, layout) in run order: A B C C B A. Each layout runs once in each pass, the second
    pass in reverse, so a machine that drifts steadily through the run favours none of them."""
    if len(set(layouts)) != len(layouts) or not layouts:
        raise ValueError(f"need distinct layout names, got {list(layouts)}")
    return [(0, name) for name in layouts] + [(1, name) for name in reversed(layouts)]


def refused(r: Record) -> bool:
    """Refused with a reason: the router said no (overload, admission), the client was told."""
    return r.error is not None and r.error.split(":", 1)[0] in REFUSED_ERRORS


def mismatched(r: Record) -> bool:
    """Completed, but not with the answer asked for: with ``ignore_eos`` every answer has
    exactly ``max_tokens`` tokens, and the tokens streamed must be the tokens counted (a
    lost or repeated chunk shows here)."""
    return r.ok and (r.output_tokens != r.max_tokens or r.streamed_tokens != r.output_tokens)


def counts(records: Sequence[Record]) -> dict:
    """sent / completed / refused / dropped / mismatched. Dropped: sent, but neither completed
    nor refused with a reason (lost, cut off, or never answered within the client's bound)."""
    sent = len(records)
    completed = sum(r.ok for r in records)
    ref = sum(refused(r) for r in records)
    return {"sent": sent, "completed": completed, "refused": ref, "dropped": sent - completed - ref,
            "mismatched": sum(mismatched(r) for r in records)}


def duration(records: Sequence[Record]) -> float:
    """First send to last finish, as serve_metrics.summarize measures a run."""
    ends = [r.end_s for r in records if r.end_s is not None]
    return max(ends) - min(r.sent_s for r in records) if ends and records else 0.0


def pooled(passes: Sequence[Sequence[Record]], slo: Slo) -> dict:
    """A layout's figures on one workload over its passes: goodput = requests within the SLO
    over the summed durations of the passes (each pass's first send to its last finish), so
    two halves of a workload weigh by their length; attainment over all requests sent."""
    good = sum(slo.met(r) for recs in passes for r in recs)
    sent = sum(len(recs) for recs in passes)
    seconds = sum(duration(recs) for recs in passes)
    per_pass = [(sum(slo.met(r) for r in recs) / d) if (d := duration(recs)) else 0.0 for recs in passes]
    return {"goodput_rps": good / seconds if seconds else 0.0, "slo_attainment": good / sent if sent else 0.0,
            "good": good, "seconds": seconds, "goodput_rps_by_pass": per_pass}


def grid_goodput(passes: Sequence[Sequence[Record]], slos: Sequence[Slo]) -> dict:
    """A layout's goodput over a grid of SLOs (each a pair of TTFT and TPOT factors): the mean
    over the grid, and each point's. Why a grid: a loaded layout's TPOT sits near any one
    factor of the unloaded TPOT, so at one point a few requests decide whether a pass scores
    most or nothing (two runs at 2x flipped the static layouts' order); the mean over
    factors on both sides of that edge moves smoothly with the layout's latency."""
    points = [pooled(passes, slo)["goodput_rps"] for slo in slos]
    return {"grid_goodput_rps": sum(points) / len(points) if points else 0.0, "grid_points": points}


def phase_oracle(good: Mapping[str, Sequence[float]]) -> float | None:
    """What switching could win on the shifting workload, at most: ``good[layout][i]`` is how
    many requests sent in phase i the layout served within the SLO (the grid's mean); a
    planner that ran, in every phase, the static layout that served that phase best, and
    switched for free, over the best static layout's whole run (None: no static layout
    served anything). An estimate, not a bound in the strict sense: a phase's requests also
    pay for the queue the one before left, which a switch at the boundary would change."""
    static = [list(v) for k, v in good.items() if k in STATIC]
    best_total = max((sum(v) for v in static), default=0.0)
    if best_total <= 0:
        return None
    return sum(max(col) for col in zip(*static)) / best_total


def role_switches(samples: Sequence[tuple[float, Mapping[str, str]]]) -> int:
    """How many times a node's served role changed across registry samples ((t, {node: role})).
    A node missing from a sample (re-registering) is skipped, not counted as a change."""
    last: dict[str, str] = {}
    n = 0
    for _, roles in samples:
        for node, role in roles.items():
            if node in last and last[node] != role:
                n += 1
            last[node] = role
    return n


def role_counts(samples: Sequence[tuple[float, Mapping[str, str]]], role: str) -> list[tuple[float, int]]:
    """(t, nodes serving ``role``) where the count changes (and the first and last samples):
    the plot's roles over time, as steps."""
    return steps([(t, sum(1 for r in roles.values() if r == role)) for t, roles in samples])


def steps(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points where the value changes, and the first and last (times to 10 ms)."""
    return [(round(t, 2), v) for i, (t, v) in enumerate(points)
            if i in (0, len(points) - 1) or v != points[i - 1][1]]


def vs_best_static(goodput: Mapping[str, float]) -> dict:
    """Elastic goodput over the best static layout's on one workload (None when no static
    layout served anything within the SLO, or a layout is missing)."""
    static = {k: goodput[k] for k in STATIC if k in goodput}
    best = max(static, key=lambda k: static[k]) if static else None
    if ELASTIC not in goodput or best is None:
        return {"best_static": best, "elastic_vs_best_static": None}
    ratio = goodput[ELASTIC] / static[best] if static[best] > 0 else None
    return {"best_static": best, "elastic_vs_best_static": ratio}


def summary(workloads: Sequence[Mapping]) -> dict:
    """The run's headline fields from its workloads (each: ``kind`` "mix" or "phases",
    ``elastic_vs_best_static``, ``by_layout`` with the elastic layout's ``dropped``):
    the worst ratio over the fixed mixes, the ratio on the shifting workload, the elastic
    layout's dropped requests over all workloads, and which targets are met."""
    mixes = [w["elastic_vs_best_static"] for w in workloads if w["kind"] == "mix"]
    phases = [w["elastic_vs_best_static"] for w in workloads if w["kind"] == "phases"]
    oracle = [w.get("phase_oracle_vs_best_static") for w in workloads if w["kind"] == "phases"]
    dropped = [w["by_layout"][ELASTIC]["dropped"] for w in workloads if ELASTIC in w["by_layout"]]
    out = {
        # A workload where the ratio is undefined (nothing within the SLO) makes the min undefined.
        "elastic_vs_best_static_min": (min(mixes) if mixes and None not in mixes else None),
        "elastic_vs_best_static_phases": phases[0] if phases else None,
        "dropped": sum(dropped) if dropped else None,
        # The per-phase best static layout, switched free, over the best static (phase_oracle):
        # what the phases ratio could reach with these two layouts to switch between.
        "oracle_vs_best_static_phases": oracle[0] if oracle else None,
    }
    out["targets"] = dict(TARGETS)
    out["met"] = {
        "elastic_vs_best_static_min": _at_least(out["elastic_vs_best_static_min"], TARGETS["elastic_vs_best_static_min"]),
        "elastic_vs_best_static_phases": _at_least(out["elastic_vs_best_static_phases"],
                                                   TARGETS["elastic_vs_best_static_phases"]),
        "dropped": None if out["dropped"] is None else out["dropped"] == TARGETS["dropped"],
    }
    return out


def _at_least(value: float | None, target: float) -> bool | None:
    return None if value is None else value >= target


def between(points: Sequence[tuple[float, object]], t0: float, t1: float) -> list:
    """The (t, value) points with t0 <= t < t1."""
    return [p for p in points if t0 <= p[0] < t1]


def counter_delta(ticks: Sequence[tuple[float, Mapping[str, float]]], t0: float, t1: float) -> dict[str, float]:
    """How much each counter grew over [t0, t1), from (t, {name: total}) readings in time
    order: the last reading before t1 less the last at or before t0 (the first reading when
    none is). Names that did not grow are left out."""
    if not ticks:
        return {}
    before = next((v for t, v in reversed(ticks) if t <= t0), ticks[0][1])
    after = next((v for t, v in reversed(ticks) if t < t1), before)
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


_DECISION = re.compile(r'^pdserve:planner_decisions_total\{([^}]*)\}\s+([0-9.eE+-]+)$')


def planner_decisions(metrics_text: str) -> dict[str, float]:
    """``"action/reason"`` -> rounds, from the router's Prometheus text."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = _DECISION.match(line.strip())
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            key = f"{labels.get('action', '?')}/{labels.get('reason', '?')}"
            out[key] = out.get(key, 0.0) + float(m.group(2))
    return out
