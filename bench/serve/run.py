"""`pdserve bench serve`: the whole serving path under load, and whether disaggregation pays.

Two modes:

    pdserve bench serve --url 127.0.0.1:50051 --rate 2 --num-requests 200        # a running cluster
    pdserve bench serve --api openai --url http://127.0.0.1:8000 --rates 0.5,1,2    # through HTTP
    pdserve bench serve --trace ../shared/data/traces/conversation_trace.jsonl --time-scale 4 --max-len 1024
    pdserve bench serve --compare colocated --json                                   # both layouts, here
    pdserve bench serve --compare elastic --json          # planner-set roles vs both fixed layouts (serve_elastic.py)

``--compare colocated`` starts two layouts of the embedded cluster one after the other on the
same cores and sends both the same request stream: 1 prefill + 1 decode node (disaggregated)
against 2 colocated nodes (each prefills and decodes its own requests with chunked prefill, as
vLLM and SGLang run by default; in pdserve a decode-role node with no prefill node beside it
does exactly that). Each node is pinned to one core (``ClusterConfig.pin_cores``) and runs one
torch thread; the router and this load generator share the machine with them, alike in both runs.

Each layout runs with its own tunable constant at its best: the disaggregated layout prefills
prompts shorter than ``--disagg-local-prefill-tokens`` on the decode node (conditional
disaggregation, as Dynamo does: a short prefill costs the decode batch less than its queueing
behind long prompts on the prefill node), the colocated layout's chunked-prefill step budget is
``--colocated-chunk-tokens``. Comma-separated candidates make a tuning run, which reports each
candidate's knee and the best one per layout; the defaults are the choices of a tuning run on
another seed than the reported one (docs/benchmarks.md says which).

Every point of a sweep (and the warm-up and unloaded requests) sends its own token ids
(``serve_workload.salted``): the same lengths, kinds and order, nothing cached by one point hit
by the next. ``--long-shares`` repeats the comparison at several shares of long documents and
reports where the winning layout changes; every share's result also carries ``slo_grid``, the
goodput ratio under other SLO factors, computed from the same records.

The SLO is set from the unloaded latencies measured in the same run: requests sent one at a
time to each layout give unloaded TTFT and TPOT medians; the SLO is ``--slo-ttft-factor`` x the
better layout's unloaded TTFT and ``--slo-tpot-factor`` x the better unloaded TPOT, the same for
both layouts (serve_metrics.slo_from_unloaded says why). The rate sweep replays one request set
at every rate, and goodput (requests within both SLOs per second) is read at each layout's
knee (its best point). Result::

    {"disagg": {...}, "colocated": {...}, "goodput_ratio": disagg knee / colocated knee,
     "tpot_p99_ratio": colocated / disagg p99 TPOT at the colocated knee's rate, "slo": {...},
     "knee_bracketed": {...}, "slo_grid": [...], "by_long_share": [...] (with --long-shares)}
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path

from bench.serve import tiers as serve_tiers
from bench.serve import workload as wl
from bench.serve.client import run_load
from bench.serve.elastic import run as serve_elastic
from bench.serve.metrics import Slo, knee, slo_from_unloaded, summarize
from bench.serve.plot import plot_crossover as _plot_crossover
from bench.serve.plot import plot_latency as _plot

REPO = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="the router: gRPC HOST:PORT, or the HTTP base URL with --api openai")
    p.add_argument("--api", choices=["grpc", "openai"], default="grpc")
    p.add_argument("--model", default="smollm2-135m", help="the served model (the cluster's, for --compare)")
    p.add_argument("--workload", choices=["mixed", "chat", "multiturn"], default="mixed",
                   help="synthetic length mix (mixed: chat turns with long documents mixed in); multiturn: "
                        "conversations whose turns repeat their history (with --compare tiers)")
    p.add_argument("--long-share", type=float, default=wl.MIXED_LONG_SHARE,
                   help="mixed workload: the fraction of requests that are long documents")
    p.add_argument("--long-shares", default=None,
                   help="--compare: run the comparison at each of these long-document shares (e.g. 0.05,0.2,0.4) "
                        "and report where the winning layout changes")
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
    p.add_argument("--compare", choices=["colocated", "tiers", "elastic"], default=None,
                   help="colocated: start 1 prefill + 1 decode and 2 colocated nodes here, one after the other; "
                        "tiers: the same 1 + 1 nodes with KV tiers and prefix fetch off, then on "
                        "(bench/serve/tiers.py); elastic: fixed 1 + 1, colocated 2 and planner-set roles, "
                        "interleaved (bench/serve/elastic/run.py)")
    p.add_argument("--disagg-local-prefill-tokens", default="256",
                   help="--compare, disaggregated layout: prompts shorter than this are prefilled on the decode node "
                        "(conditional disaggregation); comma-separated candidates make a tuning run")
    p.add_argument("--disagg-chunk-tokens", type=int, default=512, help="--compare: the disaggregated nodes' step budget")
    p.add_argument("--colocated-chunk-tokens", default="256",
                   help="--compare, colocated layout: the per-step token budget of chunked prefill; comma-separated "
                        "candidates make a tuning run")
    p.add_argument("--unloaded-requests", type=int, default=3,
                   help="requests of each kind sent one at a time, for the SLO's base")
    p.add_argument("--slo-ttft-factor", type=float, default=5.0)
    p.add_argument("--slo-tpot-factor", type=float, default=2.0)
    p.add_argument("--slo-ttft", type=float, default=None, help="absolute TTFT SLO (s), instead of the factor")
    p.add_argument("--slo-tpot", type=float, default=None, help="absolute TPOT SLO (s), instead of the factor")
    p.add_argument("--kv-cache-mib", type=int, default=256, help="per node, for --compare")
    p.add_argument("--records", default=None, help="write every request's record here (JSON lines)")
    p.add_argument("--plot", default=None, help="PNG prefix: PREFIX_cdf.png (TTFT, TPOT CDFs), PREFIX_goodput.png")
    serve_tiers.add_arguments(p)
    serve_elastic.add_arguments(p)


def _workload(args, long_share: float | None = None) -> list[wl.LoadRequest]:
    if args.trace:
        from router.replay.traces import load_trace

        return wl.from_trace(load_trace(args.trace, args.num_requests), time_scale=args.time_scale,
                             max_len=args.max_len, seed=args.seed, max_tokens_cap=args.max_tokens_cap)
    share = args.long_share if long_share is None else long_share
    mix = wl.mixed(share) if args.workload == "mixed" else wl.LengthMix(((1.0, (48, 128), (64, 128), "chat"),))
    reqs = wl.synthetic(args.num_requests, args.rate or 1.0, mix, seed=args.seed, burstiness=args.burstiness)
    if args.max_tokens_cap:
        reqs = [wl.LoadRequest(r.arrival_s, r.prompt, min(r.max_tokens, args.max_tokens_cap), r.kind) for r in reqs]
    return reqs


def _rates(args) -> list[float] | None:
    if args.rates:
        return _csv(args.rates, float)
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


def _sweep(workload, rates, target, api, model, report, label: str, salt: int = 1) -> list[tuple[float | None, list]]:
    """The workload at every rate (None: at its own arrival times), each point with its own token
    ids (``salt`` + the point's index: no point hits what another cached); -> (rate, records)."""
    out = []
    for j, rate in enumerate(rates):
        report.progress(f"{label}: {len(workload)} requests at {'trace times' if rate is None else f'{rate:g} req/s'}")
        point = wl.salted(wl.at_rate(workload, rate, seed=1) if rate else workload, salt + j)
        recs = _measure(point, target, api, model, report.progress)
        failed = sum(r.error is not None for r in recs)
        report.progress(f"{label}: done, {failed} failed")
        out.append((rate, recs))
    return out


def _points(runs, slo: Slo | None, label: str, report, records_out, extra: dict | None = None) -> list[dict]:
    points = []
    for rate, recs in runs:
        s = summarize(recs, slo)
        s["rate"] = rate
        s["_records"] = recs
        points.append(s)
        if records_out is not None:
            for r in recs:
                records_out.write(json.dumps({"layout": label, "rate": rate, **(extra or {}), **r.as_json()}) + "\n")
        report.progress(f"{label} @ {rate}: goodput {s.get('goodput_rps', 0):.3f} req/s, "
                        f"TTFT p99 {s['ttft_s']['p99'] or 0:.2f}s, TPOT p99 {s['tpot_s']['p99'] or 0:.3f}s, "
                        f"{s['failed']} failed, generator lag p99 {s['generator_lag_s']['p99']:.3f}s")
    return points


@dataclass(frozen=True, slots=True)
class Layout:
    """One layout of the comparison: how many nodes of each role, and its two tunable constants."""

    family: str  # "disagg" or "colocated"
    prefill: int
    decode: int
    # Conditional disaggregation (Dynamo's): a prompt shorter than this is prefilled on the decode
    # node; longer ones go to a prefill node (the router's short_prompt_tokens).
    local_prefill_tokens: int
    chunk_tokens: int  # the engines' per-step token budget (chunked prefill)
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.family


def _layouts(args) -> list[Layout]:
    """Every candidate of each family; with one candidate each, the names are the families."""
    local = _csv(args.disagg_local_prefill_tokens)
    chunks = _csv(args.colocated_chunk_tokens)
    out = [Layout("disagg", 1, 1, n, args.disagg_chunk_tokens, f"disagg_local{n}" if len(local) > 1 else "")
           for n in local]
    out += [Layout("colocated", 0, 2, 0, c, f"colocated_chunk{c}" if len(chunks) > 1 else "") for c in chunks]
    return out


def _csv(text, kind=int) -> list:
    """A comma-separated flag's values ("0.1,0.2", "16,256"), blanks skipped."""
    return [kind(x) for x in str(text).split(",") if x.strip()]


def _start_layout(args, layout: Layout, report):
    from deploy.launcher import ClusterConfig, LocalCluster
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig

    engine = EngineConfig(model=args.model, dtype="float32", cache=CacheConfig(kv_cache_bytes=args.kv_cache_mib * 2**20),
                          scheduler=SchedulerConfig(max_num_batched_tokens=layout.chunk_tokens))
    cfg = ClusterConfig(engine=engine, prefill_nodes=layout.prefill, decode_nodes=layout.decode, grpc_port=0,
                        http_port=0, dashboard_port=0, node_threads=1, pin_cores=True,
                        short_prompt_tokens=layout.local_prefill_tokens,
                        namespace=f"bench-serve-{layout.prefill}p{layout.decode}d-{os.getpid()}")
    return LocalCluster(cfg, report.progress).start()


# Salts that give every phase of a share its own token ids (serve_workload.salted): nothing one
# point cached is hit by the next, and both layouts see exactly the same ids at each point.
_SALT_WARMUP, _SALT_UNLOADED, _SALT_POINTS = 90, 91, 1


def _salt(share_index: int, phase: int) -> int:
    return 1000 * share_index + phase


def _compare(args, report) -> dict:
    rates = _rates(args) or [0.15, 0.3, 0.45, 0.6]
    shares = _csv(args.long_shares, float) if args.long_shares else [args.long_share]
    workloads = [_workload(args, share) for share in shares]
    layouts = _layouts(args)
    unloaded: dict[tuple[int, str], list] = {}
    runs: dict[tuple[int, str], list] = {}
    # One layout at a time on the same cores: warm up, unloaded requests (the SLO's base), the
    # sweep, for every long-prompt share. Goodput is computed afterwards, once the unloaded
    # figures of every layout fix the common SLO of each share.
    for layout in layouts:
        report.progress(f"{layout.label}: starting {layout.prefill} prefill + {layout.decode} decode node(s), one core "
                        f"each (local prefill below {layout.local_prefill_tokens} tokens, chunk {layout.chunk_tokens})")
        cluster = _start_layout(args, layout, report)
        try:
            target = cluster.address if args.api == "grpc" else f"http://{cluster.http_address}"
            for i, (share, workload) in enumerate(zip(shares, workloads)):
                report.progress(f"{layout.label}: long-prompt share {share:g}")
                _measure(wl.salted(workload[:2], _salt(i, _SALT_WARMUP)), target, args.api, args.model)  # warm-up
                unloaded[i, layout.label] = _unloaded(wl.salted(workload, _salt(i, _SALT_UNLOADED)),
                                                      args.unloaded_requests, target, args.api, args.model, report)
                runs[i, layout.label] = _sweep(workload, rates, target, args.api, args.model, report, layout.label,
                                               salt=_salt(i, _SALT_POINTS))
        finally:
            cluster.stop()
    records_out = open(args.records, "w") if args.records else None
    try:
        per_share = [_share_result(args, i, share, layouts, unloaded, runs, report, records_out)
                     for i, share in enumerate(shares)]
    finally:
        if records_out is not None:
            records_out.close()
    head = next((r for r in per_share if r["long_share"] == wl.MIXED_LONG_SHARE), per_share[0])
    out = {k: v for k, v in head.items() if not k.startswith("_")}
    out.update(rates=rates, requests_per_point=args.num_requests, workload=args.trace or args.workload,
               api=args.api, cores=len(os.sched_getaffinity(0)), seed=args.seed,
               layouts=[{"name": lay.label, "family": lay.family, "prefill": lay.prefill, "decode": lay.decode,
                         "local_prefill_tokens": lay.local_prefill_tokens, "chunk_tokens": lay.chunk_tokens}
                        for lay in layouts])
    if len(per_share) > 1:
        out["by_long_share"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in per_share]
        report.table(["long share", "disagg knee goodput", "colocated knee goodput", "goodput_ratio"],
                     [[r["long_share"], r.get("disagg", {}).get("knee", {}).get("goodput_rps"),
                       r.get("colocated", {}).get("knee", {}).get("goodput_rps"), r.get("goodput_ratio")]
                      for r in per_share])
    if args.plot:
        _plot(args.plot, {lay.label: head["_points"][lay.label] for lay in layouts}, head["_slo"])
        if len(per_share) > 1 or head.get("slo_grid"):
            _plot_crossover(args.plot, per_share, head)
    return out


def _share_result(args, i: int, share: float, layouts: list[Layout], unloaded, runs, report, records_out) -> dict:
    """One long-prompt share: the common SLO, every layout's points and knee, and (with one
    candidate per family) the goodput ratio, also over a grid of SLO factors."""
    base = [unloaded[i, lay.label] for lay in layouts]
    slo = (Slo(args.slo_ttft, args.slo_tpot) if args.slo_ttft and args.slo_tpot
           else slo_from_unloaded(base, args.slo_ttft_factor, args.slo_tpot_factor))
    report.progress(f"share {share:g}: SLO TTFT <= {', '.join(f'{k} {v:.3f}s' for k, v in slo.ttft_by_kind) or slo.ttft_s}"
                    f", TPOT <= {slo.tpot_s:.4f}s")
    points, result = {}, {"long_share": share}
    for lay in layouts:
        pts = _points(runs[i, lay.label], slo, lay.label, report, records_out, extra={"long_share": share})
        points[lay.label] = pts
        result[lay.label] = _strip(summarize(unloaded[i, lay.label]), pts, knee(pts), lay)
    result["slo"] = {**slo.as_json(), "ttft_factor": args.slo_ttft_factor, "tpot_factor": args.slo_tpot_factor,
                     "base": "per request kind, the better layout's unloaded median"}
    result["_points"], result["_slo"] = points, slo
    families = {}
    for lay in layouts:
        families.setdefault(lay.family, []).append(lay.label)
    if all(len(v) == 1 for v in families.values()) and {"disagg", "colocated"} <= families.keys():
        dk, ck = knee(points["disagg"]), knee(points["colocated"])
        at_rate = {p["rate"]: p for p in points["disagg"]}.get(ck["rate"])
        result["goodput_ratio"] = dk["goodput_rps"] / ck["goodput_rps"] if ck["goodput_rps"] else None
        result["tpot_p99_ratio"] = (ck["tpot_s"]["p99"] / at_rate["tpot_s"]["p99"]
                                    if at_rate and at_rate["tpot_s"]["p99"] and ck["tpot_s"]["p99"] else None)
        result["knee_bracketed"] = {name: _bracketed(points[name]) for name in ("disagg", "colocated")}
        if not (args.slo_ttft and args.slo_tpot):
            result["slo_grid"] = _slo_grid(base, points)
        report.table(["layout", "knee rate", "goodput req/s", "SLO met", "TTFT p99 s", "TPOT p99 s"],
                     [[n, k["rate"], k["goodput_rps"], k["slo_attainment"], k["ttft_s"]["p99"], k["tpot_s"]["p99"]]
                      for n, k in (("disagg", dk), ("colocated", ck))])
    else:
        # Candidates of a family (a tuning run): each one's knee; the choice is made here and
        # reported on other requests (another --seed), never on these.
        result["tuning"] = {fam: max(((knee(points[n])["goodput_rps"], n) for n in names))[1]
                            for fam, names in families.items()}
        report.table(["layout", "knee rate", "goodput req/s", "SLO met"],
                     [[lay.label, (k := knee(points[lay.label]))["rate"], k["goodput_rps"], k["slo_attainment"]]
                      for lay in layouts])
    return result


def _bracketed(points: list[dict]) -> bool:
    """Whether the sweep found the knee inside it: goodput fell at a higher rate than the knee's."""
    k = knee(points)
    return any(p["rate"] > k["rate"] for p in points)


# The SLO factors of the grid: DistServe reports goodput against an "SLO scale" in the same way.
SLO_GRID_TTFT = (2.0, 3.0, 5.0, 10.0, 20.0)
SLO_GRID_TPOT = (1.5, 2.0, 3.0, 5.0)


def _slo_grid(base, points: dict[str, list[dict]]) -> list[dict]:
    """goodput_ratio under other SLOs, from the same records: where on the (TTFT, TPOT) plane the
    winning layout changes."""
    out = []
    for ft in SLO_GRID_TTFT:
        for fp in SLO_GRID_TPOT:
            slo = slo_from_unloaded(base, ft, fp)
            kn = {name: knee([{"rate": p["rate"], **summarize(p["_records"], slo)} for p in pts])
                  for name, pts in points.items()}
            d, c = kn["disagg"]["goodput_rps"], kn["colocated"]["goodput_rps"]
            out.append({"ttft_factor": ft, "tpot_factor": fp, "disagg_goodput": d, "colocated_goodput": c,
                        "goodput_ratio": d / c if c else None})
    return out


def _strip(unloaded_summary: dict, points: list[dict], k: dict, layout: Layout) -> dict:
    return {"nodes": {"prefill": layout.prefill, "decode": layout.decode},
            "local_prefill_tokens": layout.local_prefill_tokens, "chunk_tokens": layout.chunk_tokens,
            "unloaded": unloaded_summary,
            "points": [{key: v for key, v in p.items() if key != "_records"} for p in points],
            "knee": {key: v for key, v in k.items() if key != "_records"}}


def run(args: argparse.Namespace, report) -> dict:
    if args.compare == "tiers" or args.workload == "multiturn":
        return serve_tiers.compare_tiers(args, report)
    if args.compare == "elastic":
        return serve_elastic.compare_elastic(args, report)
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
