"""`pdserve bench serve --compare elastic`: nodes whose roles the planner sets, against the two
fixed layouts, on the same cores and the same requests.

    pdserve bench serve --compare elastic --json
    pdserve bench serve --compare elastic --long-shares 0.1,0.4 --phases my_phases.json --json

Three layouts of the embedded cluster, each node pinned to its own core with one torch thread
(as ``--compare colocated`` runs them):

    fixed      1 prefill + 1 decode node, planner off; prompts under --disagg-local-prefill-tokens
               prefill on the decode node (that comparison's tuned threshold)
    colocated  2 decode-role nodes that prefill everything locally, chunked (--colocated-chunk-tokens)
    elastic    1 prefill + 1 decode node to start, planner active: it switches node roles and sets
               the short-prompt threshold live (router/planner/); no pool maxima, so the planner
               moves roles between the two nodes and never adds one

Workloads: each fixed mix of ``--long-shares`` (default 0.1, 0.2, 0.4) at ``--rate`` requests
per second, and the shifting workload of ``--phases FILE`` (serve_phases.py; the shipped
phases/elastic_default.json: chat-heavy, document-heavy, a burst). Without ``--rate`` the rate
follows the machine's speed: ``RATE_X_TPOT`` / the unloaded TPOT the first layout measures, or
``RATE_X_LONG_TTFT`` / its unloaded document TTFT where that is lower, and the phases' rates
scale with it (serve_elastic_rate.py, ``streams``).

Interleaved, A B C C B A (serve_elastic_figures.schedule): every layout is started twice, once
per pass, so a machine that drifts through the run favours none. In each pass a layout serves
a warm-up, its unloaded requests (the SLO's base), then two streams:

- the fixed mixes back to back, each as ``--lead-s`` seconds not measured then ``--mix-seconds``
  measured, at one rate. The lead puts every layout in its steady state before the measured
  requests (the running batch full, the elastic planner settled on what it wants for this mix,
  the previous mix's requests gone). Pass 1 and pass 2 draw different requests (one half each)
  and every layout gets the same ones;
- the phases play, the same requests in both passes, all measured: how fast the planner follows.

SLO: per request kind, a factor x the best layout's unloaded median TTFT and a factor x its
unloaded TPOT, over both passes (serve_metrics.slo_from_unloaded). The headline goodput of a
layout on a workload is the mean over a grid of factors (``--slo-grid-ttft-factors`` 3, 5, 10
x ``--slo-grid-tpot-factors`` 2, 3, 4; serve_elastic_figures.grid_goodput says why); the single
point ``--slo-ttft-factor`` x ``--slo-tpot-factor`` (5, 2, the earlier runs' SLO) is kept as
``at_slo``. The elastic planner is told the grid's middle point (5x TTFT, 3x TPOT) as its SLO and the
grid's TPOT factors over it (0.67, 1, 1.33) as its SLO band.
Goodput per layout and workload pools both passes (serve_elastic_figures.pooled). Result::

    {"elastic_vs_best_static_min", "elastic_vs_best_static_phases", "dropped", "targets", "met",
     "oracle_vs_best_static_phases" (each phase's best static layout, switched free: what the
     phases ratio could reach with these layouts; serve_elastic_figures.phase_oracle),
     "at_slo": {the two ratios at the single SLO point},
     "workloads": [{"name", "kind", "by_layout": {layout: {grid_goodput_rps, grid_points,
     goodput_rps, slo_attainment, sent, completed, refused, dropped, mismatched, role_switches,
     planner_decisions, ...}}, "best_static", "elastic_vs_best_static", "at_slo", "slo_grid"}],
     "slo", "layouts", "schedule", "seconds", ...}
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass, fields

from bench.serve import phases as ph
from bench.serve import workload as wl
from bench.serve.client import run_load
from bench.serve.elastic import figures as fig
from bench.serve.elastic.rate import auto_rate, rate_rule
from bench.serve.elastic.results import workload_result, write_records
from bench.serve.elastic.sampler import RoleSampler
from bench.serve.elastic.streams import PHASES_REFERENCE_RATE, Run, Stream, cut, streams
from bench.serve.metrics import Record, slo_from_unloaded, summarize


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("elastic comparison (--compare elastic)")
    g.add_argument("--phases", default=str(ph.DEFAULT_FILE),
                   help="the shifting workload: a JSON list of {seconds, rate, long_share[, name]} played in order "
                        "('' for none)")
    g.add_argument("--elastic-layouts", default=",".join((fig.FIXED, fig.COLOCATED, fig.ELASTIC)),
                   help="which layouts to run, in the first pass's order")
    g.add_argument("--elastic-planner", choices=["active", "advisory"], default="active",
                   help="the elastic layout's planner mode (advisory: it decides and reports only)")
    g.add_argument("--mix-seconds", type=float, default=40.0,
                   help="measured seconds of each fixed mix in each pass (two passes per layout)")
    g.add_argument("--lead-s", type=float, default=20.0,
                   help="unmeasured seconds of each fixed mix served before its measured ones (every layout)")
    g.add_argument("--planner-interval-s", type=float, default=2.0, help="the elastic planner's round")
    g.add_argument("--planner-cooldown-s", type=float, default=8.0,
                   help="the elastic planner's cool-down after an action")
    g.add_argument("--planner-window-s", type=float, default=None,
                   help="the elastic planner's signal window (default: a mix's lead and measured seconds, at most 30 s: a window that "
                        "outlasts a mix or a phase steers the planner by the previous one)")
    g.add_argument("--planner-burst-window-s", type=float, default=10.0,
                   help="the elastic planner's burst window: the last this many seconds' rate counts when it "
                        "stands out of the window's (0: the window's rate always)")
    g.add_argument("--slo-grid-ttft-factors", default="3,5,10",
                   help="the SLO grid's TTFT factors (x unloaded TTFT per kind): goodput is the mean over the grid")
    g.add_argument("--slo-grid-tpot-factors", default="2,3,4",
                   help="the SLO grid's TPOT factors (x unloaded TPOT); the elastic planner targets the grid's "
                        "middle point")
    g.add_argument("--static-planner", choices=["off", "advisory"], default="off",
                   help="advisory: the static layouts' routers run the planner too, deciding and changing nothing "
                        "(with --planner-records: what it would have done on them)")
    g.add_argument("--planner-records", default=None, metavar="PREFIX",
                   help="every planner round's signals and decision to PREFIX_<layout>_pass<N>.jsonl "
                        "(router/planner/record.py; the stream starts' wall clocks are in the result)")
    g.add_argument("--warmup-s", type=float, default=60.0,
                   help="an unmeasured slot before the schedule: the first layout serves this many seconds of a "
                        "mixed load, and its unloaded TPOT sets the rate (0: none; the first measured slot sets it)")
    g.add_argument("--elastic-chunk-tokens", type=int, default=None,
                   help="the elastic nodes' step budget (default: --colocated-chunk-tokens: a node may end up "
                        "prefilling long prompts beside its decodes)")
    g.add_argument("--fixed-decode-chunk-tokens", type=int, default=None,
                   help="the fixed layout's decode node's step budget (default: the elastic nodes' decode budget, "
                        "--elastic-chunk-tokens; its prefill node runs --disagg-chunk-tokens)")
    g.add_argument("--elastic-prefill-chunk-tokens", type=int, default=None,
                   help="the elastic nodes' step budget while in the prefill role (default: --disagg-chunk-tokens, "
                        "the fixed layout's prefill node's)")


def grid_factors(args) -> tuple[list[float], list[float]]:
    """The SLO grid's TTFT and TPOT factors (each sorted, > 0)."""
    try:
        out = tuple(sorted(float(x) for x in text.split(",") if x.strip())
                    for text in (args.slo_grid_ttft_factors, args.slo_grid_tpot_factors))
    except ValueError:
        out = ([], [])
    if not all(out) or min(min(out[0]), min(out[1])) <= 0:
        raise SystemExit(f"--slo-grid-ttft-factors / --slo-grid-tpot-factors need numbers > 0, got "
                         f"{args.slo_grid_ttft_factors!r} / {args.slo_grid_tpot_factors!r}")
    return out


def planner_slo(args) -> tuple[float, float]:
    """The elastic planner's SLO (TTFT, TPOT factors): the grid's middle point, what the
    comparison scores layouts around (it is told the SLO the static layouts are judged by)."""
    ttft, tpot = grid_factors(args)
    return ttft[len(ttft) // 2], tpot[len(tpot) // 2]


def planner_slo_band(args) -> tuple[float, ...]:
    """The elastic planner's SLO band: the grid's TPOT factors over its middle one (2, 3, 4 ->
    0.67, 1, 1.33), so it scores layouts across the grid the headline averages, not at its
    middle alone (where two layouts that both meet it tie). A diagonal through the grid (the
    TTFT factor scaled alike), not its every point: the band is one list of scales."""
    _, tpot = grid_factors(args)
    mid = tpot[len(tpot) // 2]
    return tuple(round(f / mid, 4) for f in tpot)


@dataclass(frozen=True, slots=True)
class ElasticLayout:
    name: str
    prefill: int
    decode: int
    planner: str  # off | advisory | active
    local_prefill_tokens: int  # the router's short_prompt_tokens to start with
    chunk_tokens: int  # the engines' per-step token budget
    # ... while a node prefills for others (NodeConfig.prefill_step_tokens; None: chunk_tokens)
    prefill_chunk_tokens: int | None = None


def layouts(args) -> list[ElasticLayout]:
    local, chunks = _one(args.disagg_local_prefill_tokens), _one(args.colocated_chunk_tokens)
    known = {
        # Its decode node on the elastic decode nodes' budget, its prefill node on theirs for
        # prefill: elastic holding 1P+1D is then the fixed layout exactly, and the two compare on
        # the planner's choices alone (docs/benchmarks.md, the eleventh session: on 512 against
        # elastic's 256 the elastic layout, never switching, scored 1.11-1.26x fixed in a run).
        fig.FIXED: ElasticLayout(fig.FIXED, 1, 1, "off", local,
                                 args.fixed_decode_chunk_tokens or args.elastic_chunk_tokens or chunks,
                                 args.disagg_chunk_tokens),
        fig.COLOCATED: ElasticLayout(fig.COLOCATED, 0, 2, "off", 0, chunks),
        # Its nodes prefill for others in the fixed layout's prefill node's chunks, beside decodes
        # in the colocated layout's: each role on the budget its static layout runs it on.
        fig.ELASTIC: ElasticLayout(fig.ELASTIC, 1, 1, args.elastic_planner, local, args.elastic_chunk_tokens or chunks,
                                   args.elastic_prefill_chunk_tokens or args.disagg_chunk_tokens),
    }
    names = [n.strip() for n in args.elastic_layouts.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise SystemExit(f"--elastic-layouts: unknown {bad or 'empty'}; known: {', '.join(known)}")
    return [known[n] for n in names]


def _one(text) -> int:
    values = [int(x) for x in str(text).split(",") if x.strip()]
    if len(values) != 1:
        raise SystemExit(f"--compare elastic runs each layout at one setting, got {text!r} (tune with --compare "
                         "colocated first)")
    return values[0]


def _cluster_config(args, layout: ElasticLayout, pass_index: int = 0):
    from deploy.launcher import ClusterConfig
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig

    planner = {}
    if "planner" in {f.name for f in fields(ClusterConfig)}:
        mode = layout.planner if layout.planner != "off" else args.static_planner
        planner = dict(planner=mode)
        if mode != "off":
            # No pool maxima: the planner moves roles between the nodes running and the total
            # stays (router/planner/config.py), so the layouts share the same two cores.
            ttft_f, tpot_f = planner_slo(args)
            planner.update(planner_interval_s=args.planner_interval_s, planner_cooldown_s=args.planner_cooldown_s,
                           planner_window_s=planner_window_s(args), planner_ttft_slo_factor=ttft_f,
                           planner_burst_window_s=args.planner_burst_window_s,
                           planner_tpot_slo_factor=tpot_f, planner_slo_band=planner_slo_band(args))
            if args.planner_records:
                planner.update(planner_record=f"{args.planner_records}_{layout.name}_pass{pass_index + 1}.jsonl")
    elif layout.planner != "off":
        raise SystemExit("the elastic layout needs the planner (ClusterConfig.planner), which this tree does not "
                         "have; run --elastic-layouts fixed,colocated")
    engine = EngineConfig(model=args.model, dtype="float32", cache=CacheConfig(kv_cache_bytes=args.kv_cache_mib * 2**20),
                          scheduler=SchedulerConfig(max_num_batched_tokens=layout.chunk_tokens))
    if layout.prefill_chunk_tokens not in (None, layout.chunk_tokens):
        if "prefill_step_tokens" not in {f.name for f in fields(ClusterConfig)}:
            raise SystemExit("this tree has no per-role step budget (ClusterConfig.prefill_step_tokens); pass "
                             "--elastic-prefill-chunk-tokens equal to the elastic chunk tokens")
        planner.update(prefill_step_tokens=layout.prefill_chunk_tokens)
    return ClusterConfig(engine=engine, prefill_nodes=layout.prefill, decode_nodes=layout.decode, grpc_port=0,
                         http_port=0, dashboard_port=0, node_threads=1, pin_cores=True,
                         short_prompt_tokens=layout.local_prefill_tokens,
                         namespace=f"bench-elastic-{layout.name}-{os.getpid()}", **planner)


# The longest default window: the shipped shifting workload's phases last 20-40 s.
PHASE_WINDOW_S = 30.0


def planner_window_s(args) -> float:
    """The elastic planner's signal window: --planner-window-s, else a mix's length (lead and
    measured seconds), at most PHASE_WINDOW_S. Longer, the window would mostly describe the
    previous mix or phase when the planner settles on the next one; shorter, it holds too few
    requests at these rates to tell the layouts apart (a 15 s window at 0.5 requests a second
    holds about 7 arrivals: the offered rate it measures swings by +-40%, and the planner of
    the tuning run changed its mind round after round)."""
    if args.planner_window_s is not None:
        return args.planner_window_s
    return min(max(args.lead_s, 0.0) + args.mix_seconds, PHASE_WINDOW_S)


def _unloaded(cluster, per_kind: int, seed: int) -> list[Record]:
    """``per_kind`` requests of each kind, one at a time: what nothing else delays."""
    pool = wl.synthetic(8 * per_kind + 8, 1.0, wl.mixed(0.5), seed=seed)
    chosen = []
    for kind in ("chat", "long"):
        chosen += [r for r in pool if r.kind == kind][:per_kind]
    records = []
    for r in chosen:
        records += asyncio.run(run_load([wl.LoadRequest(0.0, r.prompt, r.max_tokens, r.kind)],
                                        target=cluster.address, api="grpc"))
    return records


def _slot(args, layout: ElasticLayout, pass_index: int, plan_for, report):
    """One layout's pass: start it, warm up, unloaded requests, every stream; stop it.
    ``plan_for(unloaded records)`` -> the streams (the first slot's unloaded TPOT sets the rate)."""
    from deploy.launcher import LocalCluster

    report.progress(f"pass {pass_index + 1}: {layout.name}: {layout.prefill} prefill + {layout.decode} decode node(s), "
                    f"planner {layout.planner}, local prefill below {layout.local_prefill_tokens}, chunk "
                    f"{layout.chunk_tokens}" + (f" ({layout.prefill_chunk_tokens} prefilling for others)"
                                                if layout.prefill_chunk_tokens not in (None, layout.chunk_tokens) else ""))
    cluster = LocalCluster(_cluster_config(args, layout, pass_index), report.progress).start()
    runs: dict[str, Run] = {}
    starts = []
    try:
        warm = wl.synthetic(2, 1.0, wl.mixed(0.5), seed=args.seed * 1000 + 900 + pass_index)
        asyncio.run(run_load(warm, target=cluster.address, api="grpc"))
        # --unloaded-requests per kind and layout, split over its two passes.
        unloaded = _unloaded(cluster, max(1, args.unloaded_requests // 2), args.seed * 1000 + 950 + pass_index)
        for stream in plan_for(unloaded):
            reqs = stream.requests(pass_index, args.max_tokens_cap)
            report.progress(f"{layout.name}: {stream.name}: {len(reqs)} requests over {ph.total_seconds(stream.phases):.0f} s")
            starts.append({"layout": layout.name, "pass": pass_index + 1, "stream": stream.name,
                           "wall_start": time.time()})
            with RoleSampler(cluster) as sampler:
                records = asyncio.run(run_load(reqs, target=cluster.address, api="grpc", progress=report.progress))
            for name, run in cut(stream, records, sampler).items():
                runs[name] = run
                c = fig.counts(run.records)
                report.progress(f"{layout.name}: {name}: {c['completed']}/{c['sent']} completed, {c['refused']} "
                                f"refused, {c['dropped']} dropped, {fig.role_switches(run.samples)} role switch(es)")
    finally:
        cluster.stop()
    return unloaded, runs, starts


def _warmup_slot(args, layout: ElasticLayout, report) -> list[Record]:
    """An unmeasured slot before the schedule: ``layout`` started, its unloaded requests (whose
    TPOT sets the rate), ``--warmup-s`` of a mixed load at that rate, stopped. Why: in the
    A/A run of 2026-12-02 (two identical layouts) the first slot of the first pass served
    1.2-1.6x less than the second on every workload, and the second pass's two were within 4%:
    whatever the first slot pays for (a cold machine, caches), no layout should pay it alone,
    and A B C C B A gives the first layout's first pass the first slot always."""
    from deploy.launcher import LocalCluster

    report.progress(f"warm-up slot: {layout.name}, {args.warmup_s:.0f} s unmeasured")
    cluster = LocalCluster(_cluster_config(args, layout, -1), report.progress).start()
    try:
        asyncio.run(run_load(wl.synthetic(2, 1.0, wl.mixed(0.5), seed=args.seed * 1000 + 989), target=cluster.address,
                             api="grpc"))
        unloaded = _unloaded(cluster, max(1, args.unloaded_requests // 2), args.seed * 1000 + 990)
        rate = args.rate if args.rate is not None else auto_rate(unloaded)
        load = wl.synthetic(max(1, round(rate * args.warmup_s)), rate, wl.mixed(0.2), seed=args.seed * 1000 + 991)
        asyncio.run(run_load(load, target=cluster.address, api="grpc"))
    finally:
        cluster.stop()
    return unloaded


def compare_elastic(args, report) -> dict:
    if args.api != "grpc":
        raise SystemExit("--compare elastic measures through the gRPC API (it counts streamed tokens)")
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    lays = layouts(args)
    streams(args)  # the flags checked before any cluster starts
    rate: float | None = args.rate
    rule = "--rate"
    plan: list[Stream] = []

    def plan_for(first_unloaded: list[Record]) -> list[Stream]:
        """The streams, built once: at the first slot's call its unloaded medians set the rate."""
        nonlocal rate, rule
        if not plan:
            if rate is None:
                rate = auto_rate(first_unloaded)
                rule = rate_rule(first_unloaded, rate)
                report.progress(f"rate {rate:g} requests/s ({rule}; phases x {rate / PHASES_REFERENCE_RATE:.2f})")
            plan.extend(streams(args, rate))
        return plan

    unloaded: dict[str, list[Record]] = {lay.name: [] for lay in lays}
    runs: dict[tuple[str, str], list[Run]] = {}
    by_name = {lay.name: lay for lay in lays}
    order = fig.schedule([lay.name for lay in lays])
    if args.warmup_s > 0:
        plan_for(_warmup_slot(args, by_name[order[0][1]], report))  # the rate, from a slot nobody is judged on
    stream_starts = []
    for pass_index, name in order:
        u, r, starts = _slot(args, by_name[name], pass_index, plan_for, report)
        stream_starts += starts
        unloaded[name] += u
        for wname, run in r.items():
            runs.setdefault((name, wname), []).append(run)  # pass 1 first: the schedule runs it first
    slo = slo_from_unloaded(list(unloaded.values()), args.slo_ttft_factor, args.slo_tpot_factor)
    ttft_grid, tpot_grid = grid_factors(args)
    grid = [(ft, fp, slo_from_unloaded(list(unloaded.values()), ft, fp)) for ft in ttft_grid for fp in tpot_grid]
    report.progress(f"SLO TTFT <= {', '.join(f'{k} {v:.3f}s' for k, v in slo.ttft_by_kind)}, "
                    f"TPOT <= {slo.tpot_s:.4f}s; grid TTFT x {ttft_grid}, TPOT x {tpot_grid}")
    segments = [(stream, seg) for stream in plan for seg in stream.segments]
    results = [workload_result(stream, seg, lays, runs, slo, grid) for stream, seg in segments]
    phases = next((s.phases for s in plan if s.name == "phases"), None)
    out = fig.summary(results)
    at_slo = fig.summary([{**w, "elastic_vs_best_static": w["at_slo"]["elastic_vs_best_static"]} for w in results])
    out.update(
        at_slo={k: at_slo[k] for k in ("elastic_vs_best_static_min", "elastic_vs_best_static_phases")},
        workloads=results,
        slo={**slo.as_json(), "ttft_factor": args.slo_ttft_factor, "tpot_factor": args.slo_tpot_factor,
             "base": "per request kind, the best layout's unloaded median over both passes",
             "grid": {"ttft_factors": ttft_grid, "tpot_factors": tpot_grid,
                      "headline": "goodput is the mean over the grid's points; at_slo: the single point above"}},
        unloaded={n: summarize(u) for n, u in unloaded.items()},
        layouts=[{"name": x.name, "prefill": x.prefill, "decode": x.decode, "planner": x.planner,
                  "local_prefill_tokens": x.local_prefill_tokens, "chunk_tokens": x.chunk_tokens,
                  "prefill_chunk_tokens": x.prefill_chunk_tokens or x.chunk_tokens} for x in lays],
        schedule=[f"{name}#{p + 1}" for p, name in order],
        rate=rate, rate_rule=("--rate" if args.rate is not None else
                              (f"{rule}: the first layout's unloaded medians" + (" in the warm-up slot" if
                                                                                 args.warmup_s > 0 else ""))),
        warmup_s=args.warmup_s,
        mix_seconds=args.mix_seconds, lead_s=args.lead_s,
        phases=[{"name": p.label(i), "seconds": p.seconds, "rate": p.rate, "long_share": p.long_share}
                for i, p in enumerate(phases)] if phases else None,
        planner=({"mode": args.elastic_planner, "interval_s": args.planner_interval_s,
                  "cooldown_s": args.planner_cooldown_s, "window_s": planner_window_s(args),
                  "burst_window_s": args.planner_burst_window_s,
                  "slo_factors": dict(zip(("ttft", "tpot"), planner_slo(args))),
                  "slo_band": list(planner_slo_band(args))}
                 if fig.ELASTIC in by_name else None),
        stream_starts=stream_starts, static_planner=args.static_planner,
        seed=args.seed, cores=len(os.sched_getaffinity(0)), seconds=time.monotonic() - t0,
        load_average={"before": load0, "after": os.getloadavg()[0]},
    )
    report.table(["workload", *[x.name for x in lays], "best static", "elastic / best", "elastic dropped"],
                 [[w["name"], *[w["by_layout"][x.name]["grid_goodput_rps"] for x in lays], w["best_static"],
                   w["elastic_vs_best_static"], w["by_layout"].get(fig.ELASTIC, {}).get("dropped")] for w in results])
    if args.records:
        write_records(args.records, runs)
    if args.plot:
        from bench.serve.elastic.plot import plot

        plot(args.plot, out)
    return out
