"""`pdserve bench serve --compare elastic`'s figures per workload and its records file: what
serve_elastic.py measured, pooled per layout over the passes (serve_elastic_figures.py holds
the arithmetic they share)."""
from __future__ import annotations

import json

from bench.serve import phases as ph
from bench.serve.elastic import figures as fig
from bench.serve.metrics import Record, summarize


def workload_result(stream, seg, lays, runs, slo, grid) -> dict:
    """One workload's figures per layout: ``grid_goodput_rps`` (the headline: the mean over the
    SLO grid ``grid``, (ttft factor, tpot factor, Slo) triples) and every single-SLO figure at
    ``slo``; the elastic layout's ratio to the best static one on the grid and at ``slo``."""
    by_layout = {}
    for lay in lays:
        rs = runs[lay.name, seg.workload]
        measured = [x for r in rs for x in r.measured]
        decisions: dict[str, float] = {}
        for r in rs:
            for k, v in r.decisions.items():
                decisions[k] = decisions.get(k, 0.0) + v
        by_layout[lay.name] = {
            **fig.grid_goodput([r.measured for r in rs], [g[2] for g in grid]),
            **fig.pooled([r.measured for r in rs], slo), **fig.counts([x for r in rs for x in r.records]),
            "measured": len(measured), "role_switches": sum(fig.role_switches(r.samples) for r in rs),
            "nodes_max": max((len(s) for r in rs for _, s in r.samples), default=0), "planner_decisions": decisions,
            "ttft_p99_s": summarize(measured)["ttft_s"]["p99"], "tpot_p99_s": summarize(measured)["tpot_s"]["p99"],
        }
        if any(r.plans for r in rs):
            by_layout[lay.name]["plan_changes"] = [r.plans for r in rs]  # per pass: why it acted or held
        if seg.kind == "phases":
            by_layout[lay.name]["roles_over_time"] = [
                {"pass": i + 1, "prefill_nodes": fig.role_counts(r.samples, "prefill"),
                 "thresholds": fig.steps(r.thresholds)} for i, r in enumerate(rs)]
            by_layout[lay.name]["by_phase"] = _by_phase(stream.phases, [r.measured for r in rs], slo,
                                                        [g[2] for g in grid])
    out = {"name": seg.workload, "kind": seg.kind, "long_share": seg.long_share, "by_layout": by_layout}
    out.update(fig.vs_best_static({n: v["grid_goodput_rps"] for n, v in by_layout.items()}))
    out["at_slo"] = fig.vs_best_static({n: v["goodput_rps"] for n, v in by_layout.items()})
    if seg.kind == "phases":
        out["phase_oracle_vs_best_static"] = fig.phase_oracle(
            {n: [p["good_grid"] for p in v["by_phase"]] for n, v in by_layout.items()})
    out["slo_grid"] = [{"ttft_factor": ft, "tpot_factor": fp,
                        "goodput_rps": {n: round(v["grid_points"][i], 4) for n, v in by_layout.items()}}
                       for i, (ft, fp, _) in enumerate(grid)]
    return out


def _by_phase(phases, passes: list[list[Record]], slo, grid) -> list[dict]:
    """Per phase, the requests sent in it (both passes together): their SLO attainment at
    ``slo``, and how many met each of ``grid``'s SLOs, the mean over them (``good_grid``: what
    fig.phase_oracle compares)."""
    out = []
    for i, p in enumerate(phases):
        recs = [r for recs in passes for r in recs if ph.phase_index(phases, r.scheduled_s) == i]
        out.append({"phase": p.label(i), "requests": len(recs),
                    "slo_attainment": sum(slo.met(r) for r in recs) / len(recs) if recs else None,
                    "good_grid": sum(g.met(r) for g in grid for r in recs) / len(grid) if grid else 0.0})
    return out


def write_records(path: str, runs) -> None:
    with open(path, "w") as f:
        for (layout, workload), rs in runs.items():
            for i, run in enumerate(rs):
                measured = {id(r) for r in run.measured}
                for rec in run.records:
                    f.write(json.dumps({"layout": layout, "workload": workload, "pass": i + 1,
                                        "measured": id(rec) in measured, **rec.as_json()}) + "\n")
