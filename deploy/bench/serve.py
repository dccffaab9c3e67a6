"""`pdserve bench serve`: the whole serving path under load, and whether disaggregation pays.

Two modes:

    pdserve bench serve --url 127.0.0.1:50051 --rate 2 --num-requests 200        # a running cluster
    pdserve bench serve --api openai --url http://127.0.0.1:8000 --rates 0.5,1,2    # through HTTP
    pdserve bench serve --trace ../shared/data/traces/conversation_trace.jsonl --time-scale 4 --max-len 1024
    pdserve bench serve --compare colocated --json                                   # both layouts, here

``--compare colocated`` starts two layouts of the embedded cluster one after the other on the
same cores and sends both the same request stream: 1 prefill + 1 decode node (disaggregated)
against 2 colocated nodes (each prefills and decodes its own requests with chunked prefill, as
vLLM and SGLang run by default; in pdserve a decode-role node with no prefill node beside it
does exactly that). Each node is pinned to one core (``ClusterConfig.pin_cores``) and runs one
torch thread; the router and this load generator share the machine with them, alike in both runs.

The SLO is set from the unloaded latencies measured in the same run: requests sent one at a
time to each layout give unloaded TTFT and TPOT medians; the SLO is ``--slo-ttft-factor`` x the
better layout's unloaded TTFT and ``--slo-tpot-factor`` x the better unloaded TPOT, the same for
both layouts (serve_metrics.slo_from_unloaded says why). The rate sweep replays one request set
at every rate, and goodput (requests within both SLOs per second) is read at each layout's
knee (its best point). Result::

    {"disagg": {...}, "colocated": {...}, "goodput_ratio": disagg knee / colocated knee,
     "tpot_p99_ratio": colocated / disagg p99 TPOT at the colocated knee's rate, "slo": {...}}
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from deploy.bench import serve_workload as wl
from deploy.bench.serve_client import run_load
from deploy.bench.serve_metrics import Slo, knee, slo_from_unloaded, summarize

REPO = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="the router: gRPC HOST:PORT, or the HTTP base URL with --api openai")
    p.add_argument("--api", choices=["grpc", "openai"], default="grpc")
    p.add_argument("--model", default="smollm2-135m", help="the served model (the cluster's, for --compare)")
    p.add_argument("--workload", choices=["mixed", "chat"], default="mixed",
                   help="synthetic length mix (mixed: chat turns with long documents mixed in)")
    p.add_argument("--trace", default=None, help="replay a Mooncake JSONL or Azure CSV trace's arrivals and lengths")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's gaps (2 = half the rate)")
    p.add_argument("--max-len", type=int, default=1024, help="scale the trace's lengths so its longest prompt fits")
    p.add_argument("--max-tokens-cap", type=int, default=256, help="cap every request's output length")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=None, help="requests per second (Poisson, or gamma with --burstiness)")
    p.add_argument("--rates", default=None, help="comma-separated sweep, e.g. 0.2,0.4,0.8")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson, < 1 burstier)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: keep N requests in flight instead of arrivals at a rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", choices=["colocated"], default=None,
                   help="start 1 prefill + 1 decode and 2 colocated nodes here, one after the other")
    p.add_argument("--unloaded-requests", type=int, default=3,
                   help="requests of each kind sent one at a time, for the SLO's base")
    p.add_argument("--slo-ttft-factor", type=float, default=5.0)
    p.add_argument("--slo-tpot-factor", type=float, default=2.0)
    p.add_argument("--slo-ttft", type=float, default=None, help="absolute TTFT SLO (s), instead of the factor")
    p.add_argument("--slo-tpot", type=float, default=None, help="absolute TPOT SLO (s), instead of the factor")
    p.add_argument("--kv-cache-mib", type=int, default=256, help="per node, for --compare")
    p.add_argument("--records", default=None, help="write every request's record here (JSON lines)")
    p.add_argument("--plot", default=None, help="PNG prefix: PREFIX_cdf.png (TTFT, TPOT CDFs), PREFIX_goodput.png")


def _workload(args) -> list[wl.LoadRequest]:
    if args.trace:
        from router.replay.traces import load_trace

        return wl.from_trace(load_trace(args.trace, args.num_requests), time_scale=args.time_scale,
                             max_len=args.max_len, seed=args.seed, max_tokens_cap=args.max_tokens_cap)
    mix = wl.MIXED if args.workload == "mixed" else wl.LengthMix(((1.0, (48, 128), (64, 128), "chat"),))
    reqs = wl.synthetic(args.num_requests, args.rate or 1.0, mix, seed=args.seed, burstiness=args.burstiness)
    if args.max_tokens_cap:
        reqs = [wl.LoadRequest(r.arrival_s, r.prompt, min(r.max_tokens, args.max_tokens_cap), r.kind) for r in reqs]
    return reqs


def _rates(args) -> list[float] | None:
    if args.rates:
        return [float(x) for x in args.rates.split(",") if x.strip()]
    return [args.rate] if args.rate else None


def _measure(workload, target: str, api: str, model: str, progress=None, concurrency: int | None = None) -> list:
    return asyncio.run(run_load(workload, target=target, api=api, model=model, concurrency=concurrency,
                                progress=progress))


def _unloaded(workload, per_kind: int, target: str, api: str, model: str, report) -> list:
    """``per_kind`` requests of each kind in the workload, one at a time (each sent when the
    previous finished): the latencies nothing else delays."""
    records, seen = [], {}
    for req in workload:
        if seen.get(req.kind, 0) >= per_kind:
            continue
        seen[req.kind] = seen.get(req.kind, 0) + 1
        records += _measure([wl.LoadRequest(0.0, req.prompt, req.max_tokens, req.kind)], target, api, model)
    s = summarize(records)
    report.progress(f"unloaded: TTFT p50 {s['ttft_s']['p50']:.3f}s, TPOT p50 {s['tpot_s']['p50']:.4f}s "
                    f"({', '.join(f'{k} x{n}' for k, n in seen.items())})")
    return records


def _sweep(workload, rates, target, api, model, report, label: str) -> list[tuple[float | None, list]]:
    """The workload at every rate (None: at its own arrival times); -> (rate, records) per point."""
    out = []
    for rate in rates:
        report.progress(f"{label}: {len(workload)} requests at {'trace times' if rate is None else f'{rate:g} req/s'}")
        recs = _measure(wl.at_rate(workload, rate, seed=1) if rate else workload, target, api, model, report.progress)
        failed = sum(r.error is not None for r in recs)
        report.progress(f"{label}: done, {failed} failed")
        out.append((rate, recs))
    return out


def _points(runs, slo: Slo | None, label: str, report, records_out) -> list[dict]:
    points = []
    for rate, recs in runs:
        s = summarize(recs, slo)
        s["rate"] = rate
        s["_records"] = recs
        points.append(s)
        if records_out is not None:
            for r in recs:
                records_out.write(json.dumps({"layout": label, "rate": rate, **r.as_json()}) + "\n")
        report.progress(f"{label} @ {rate}: goodput {s.get('goodput_rps', 0):.3f} req/s, "
                        f"TTFT p99 {s['ttft_s']['p99'] or 0:.2f}s, TPOT p99 {s['tpot_s']['p99'] or 0:.3f}s, "
                        f"{s['failed']} failed, generator lag p99 {s['generator_lag_s']['p99']:.3f}s")
    return points


def _start_layout(args, prefill: int, decode: int, report):
    from deploy.launcher import ClusterConfig, LocalCluster
    from engine.config import CacheConfig, EngineConfig

    engine = EngineConfig(model=args.model, dtype="float32", cache=CacheConfig(kv_cache_bytes=args.kv_cache_mib * 2**20))
    cfg = ClusterConfig(engine=engine, prefill_nodes=prefill, decode_nodes=decode, grpc_port=0, http_port=0,
                        dashboard_port=0, node_threads=1, pin_cores=True,
                        namespace=f"bench-serve-{prefill}p{decode}d-{os.getpid()}")
    return LocalCluster(cfg, report.progress).start()


def _compare(args, report) -> dict:
    workload = _workload(args)
    rates = _rates(args) or [0.1, 0.2, 0.3, 0.45]
    layouts = {"disagg": (1, 1), "colocated": (0, 2)}
    unloaded, runs = {}, {}
    # One layout at a time on the same cores: warm up, unloaded requests (the SLO's base), the
    # sweep. Goodput is computed afterwards, once both unloaded figures fix the common SLO.
    for name, (p, d) in layouts.items():
        report.progress(f"{name}: starting {p} prefill + {d} decode node(s), one core each")
        cluster = _start_layout(args, p, d, report)
        try:
            target = cluster.address if args.api == "grpc" else f"http://{cluster.http_address}"
            _measure(workload[:2], target, args.api, args.model)  # warm-up, alike for both
            unloaded[name] = _unloaded(workload, args.unloaded_requests, target, args.api, args.model, report)
            runs[name] = _sweep(workload, rates, target, args.api, args.model, report, name)
        finally:
            cluster.stop()
    slo = (Slo(args.slo_ttft, args.slo_tpot) if args.slo_ttft and args.slo_tpot
           else slo_from_unloaded(unloaded.values(), args.slo_ttft_factor, args.slo_tpot_factor))
    report.progress(f"SLO: TTFT <= {', '.join(f'{k} {v:.3f}s' for k, v in slo.ttft_by_kind) or slo.ttft_s}, "
                    f"TPOT <= {slo.tpot_s:.4f}s")
    records_out = open(args.records, "w") if args.records else None
    try:
        results = {name: {"nodes": {"prefill": p, "decode": d}, "unloaded": summarize(unloaded[name]),
                          "points": _points(runs[name], slo, name, report, records_out)}
                   for name, (p, d) in layouts.items()}
    finally:
        if records_out is not None:
            records_out.close()
    dk, ck = knee(results["disagg"]["points"]), knee(results["colocated"]["points"])
    at_rate = {p["rate"]: p for p in results["disagg"]["points"]}.get(ck["rate"])
    out = {
        "disagg": _strip(results["disagg"], dk), "colocated": _strip(results["colocated"], ck),
        "goodput_ratio": dk["goodput_rps"] / ck["goodput_rps"] if ck["goodput_rps"] else None,
        "tpot_p99_ratio": (ck["tpot_s"]["p99"] / at_rate["tpot_s"]["p99"]
                           if at_rate and at_rate["tpot_s"]["p99"] and ck["tpot_s"]["p99"] else None),
        "slo": {**slo.as_json(), "ttft_factor": args.slo_ttft_factor, "tpot_factor": args.slo_tpot_factor,
                "base": "per request kind, the better layout's unloaded median"},
        "rates": rates, "requests_per_point": len(workload), "workload": args.trace or args.workload,
        "api": args.api, "cores": len(os.sched_getaffinity(0)),
    }
    report.table(["layout", "knee rate", "goodput req/s", "SLO met", "TTFT p99 s", "TPOT p99 s"],
                 [[n, k["rate"], k["goodput_rps"], k["slo_attainment"], k["ttft_s"]["p99"], k["tpot_s"]["p99"]]
                  for n, k in (("disagg", dk), ("colocated", ck))])
    if args.plot:
        _plot(args.plot, {"disagg": results["disagg"]["points"], "colocated": results["colocated"]["points"]}, slo)
    return out


def _strip(layout: dict, k: dict) -> dict:
    points = [{key: v for key, v in p.items() if key != "_records"} for p in layout["points"]]
    return {"nodes": layout["nodes"], "unloaded": layout["unloaded"], "points": points,
            "knee": {key: v for key, v in k.items() if key != "_records"}}


def run(args: argparse.Namespace, report) -> dict:
    if args.compare:
        return _compare(args, report)
    if not args.url:
        raise SystemExit("--url is required without --compare (the router's gRPC address, or HTTP URL with --api "
                         "openai)")
    target = args.url if args.api == "grpc" or args.url.startswith("http") else f"http://{args.url}"
    workload = _workload(args)
    slo = Slo(args.slo_ttft, args.slo_tpot) if args.slo_ttft and args.slo_tpot else None
    if args.concurrency:
        report.progress(f"run: {len(workload)} requests, {args.concurrency} in flight")
        runs = [(None, _measure(workload, target, args.api, args.model, report.progress, args.concurrency))]
    else:
        rates = (_rates(args) or [None]) if not args.trace else [None]
        runs = _sweep(workload, rates, target, args.api, args.model, report, "run")
    records_out = open(args.records, "w") if args.records else None
    try:
        points = _points(runs, slo, "run", report, records_out)
    finally:
        if records_out is not None:
            records_out.close()
    report.table(["rate", "done", "failed", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                  "goodput"],
                 [[p["rate"] if p["rate"] is not None else "trace", p["completed"], p["failed"],
                   p["request_throughput"], p["output_throughput"], p["ttft_s"]["p50"], p["ttft_s"]["p99"],
                   p["tpot_s"]["p50"], p["tpot_s"]["p99"], p.get("goodput_rps", "-")] for p in points])
    if args.plot:
        _plot(args.plot, {"run": points}, slo)
    clean = [{k: v for k, v in p.items() if k != "_records"} for p in points]
    return {"points": clean, "slo": None if slo is None else slo.as_json(),
            "requests_per_point": len(workload), "workload": args.trace or args.workload, "api": args.api}


def _plot(prefix: str, layouts: dict[str, list[dict]], slo: Slo | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, points in layouts.items():
        top = max(points, key=lambda p: p["rate"] or 0)  # the heaviest load: where layouts differ
        recs = [r for r in top["_records"] if r.ok]
        for ax, values, what in ((axes[0], [r.ttft for r in recs], "TTFT"),
                                 (axes[1], [t for r in recs if (t := r.tpot) is not None], "TPOT")):
            xs = sorted(values)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{name} @ {top['rate']} req/s")
            ax.set_xlabel(f"{what} (s)")
            ax.set_ylabel("fraction of requests")
    if slo is not None:
        axes[0].axvline(slo.ttft_s, color="grey", ls="--", lw=1, label="SLO")
        axes[1].axvline(slo.tpot_s, color="grey", ls="--", lw=1, label="SLO")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{prefix}_cdf.png", dpi=120)
    plt.close(fig)
    if slo is None or not any(len(p) > 1 for p in layouts.values()):
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for name, points in layouts.items():
        ps = sorted(points, key=lambda p: p["rate"])
        ax.plot([p["rate"] for p in ps], [p["goodput_rps"] for p in ps], marker="o", label=name)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("goodput (requests/s within SLO)")
    ttft = ", ".join(f"{k} {v:.2f}s" for k, v in slo.ttft_by_kind) or f"{slo.ttft_s:.2f}s"
    ax.set_title(f"TTFT <= {ttft}; TPOT <= {slo.tpot_s * 1000:.0f} ms", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{prefix}_goodput.png", dpi=120)
    plt.close(fig)
