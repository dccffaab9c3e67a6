"""`pdserve bench router --trace PATH`: replay a real trace through the placement policies.

Every policy runs on the same requests, in simulated time, against one real redis-server
started for the run (or --redis-url): simulated prefill nodes publish their block events through
``NodePublisher``, routers that read the KV-event index look prefixes up through
``IndexReader.match`` (one script call per request), and pdserve's ``TtftPolicy`` predicts with
a ``CostBook`` that starts from the generic prior and is fitted online from the simulated nodes'
step reports. Baselines (router.replay.baselines) and the global-pool upper bound run in the
same process on the same arrivals. See router/replay/simulator.py for the node model.

Equal terms: one admission gate for every policy (``--admission same_for_all``, the default) or
none; a rejection is an SLO miss. Columns: token hit ratio; goodput (requests whose TTFT met the
SLO class budget, per simulated second of the trace); TTFT mean / p50 / p99 over the requests
every policy in the run served; SLO attainment (TTFT and TBT; rejected requests are misses);
imbalance = max / mean prefill busy time; requests rejected; Redis round trips per request on
the router's path (node-side publishes separately).

Tiers: ``--host-cache-tokens N --disk-cache-tokens M`` give every prefill node a host-memory
and a disk tier below its device pool (``--cache-tokens``), LRU demotion down the tiers; a hit
there is onboarded at the tier's true cost (``--host-gbs``, ``--disk-gbs``), which pdserve's book
learns from the nodes' reports. The peers whose real routers know tiers use their published
tier weights (router/replay/baselines.py), SGLang's trees span a node's whole hierarchy, and the
global pool gets the cluster's whole capacity, tier by tier. The JSON adds each policy's reused
tokens per tier (``hit_tokens``: device, host, disk, and remote for fetched ones).

``pdserve`` fetches a longer prefix from the node that holds it when that beats recomputing
(``replicate``, on in the live router too); ``pdserve_no_fetch`` never fetches.

Constants (pdserve's compute_weight, each peer's main knob) are chosen on a tuning split,
``TUNED_ON``, by ``--tune`` (the best goodput, then the lowest mean TTFT); every other trace and
the held-out half are reported with them unchanged.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import time
import uuid

import redis

from bench.plotting import figure
from deploy.redis_server import RedisServer
from kv_index.client import RedisTimeouts, redis_client
from kv_index.nodes import NodeInfo
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from router.admission import SLO_CLASSES
from router.cost_model import CostBook
from router.placement import PlacementPolicy, TtftPolicy
from router.replay.baselines import BASELINES, LLMD_TIER_WEIGHTS, LlmdWeighted, SglangCacheAware
from router.replay.simulator import (
    ADMISSION_MODES,
    IndexLink,
    PolicyResult,
    SimConfig,
    TierTruth,
    simulate,
    time_scale,
)
from router.replay.traces import TraceRequest, load_trace

PDSERVE = ("pdserve", "pdserve_no_fetch")
POLICIES = (*PDSERVE, *BASELINES, "global_pool")
SPLITS = ("all", "tune", "holdout")

# The tuning split: the first half of the Mooncake conversation trace, in arrival order
# (`--split tune`); `--split holdout` is the second half. The constants below were chosen there
# by `pdserve bench router --trace ../shared/data/traces/conversation_trace.jsonl --split tune
# --tune` (docs/benchmarks.md has the sweep).
TUNED_ON = "conversation_trace.jsonl:tune"
# policy -> {constant: (the values --tune tries, the value chosen on TUNED_ON)}; the rest of
# each peer's constants are its router's defaults.
KNOBS: dict[str, dict[str, tuple[tuple[float, ...], float]]] = {
    "pdserve": {"compute_weight": ((0.0, 1.0, 2.0, 4.0, 8.0), 2.0)},
    "pdserve_no_fetch": {"compute_weight": ((0.0, 1.0, 2.0, 4.0, 8.0), 1.0)},
    "dynamo_kv": {"overlap_weight": ((0.5, 1.0, 2.0, 4.0), 4.0)},
    "sglang_cache_aware": {"cache_threshold": ((0.1, 0.3, 0.5), 0.5), "balance_abs": ((4, 16, 64), 4)},
    "llmd_weighted": {"prefix_weight": ((1.0, 3.0, 6.0, 12.0, 24.0), 24.0)},
}
# With tiers llm-d scores prefixes by its precise scorer, min-max normalised over the pods (every
# conversation starts with the same block, so the pod holding one block more scores 1 and the
# rest 0): its weight is tuned for that scorer, on the same split with tiers (--cache-tokens
# 1000000 --host-cache-tokens 2000000 --disk-cache-tokens 8000000 --tune): 3 to 24 tie there,
# the first wins (3, also its default profile's); at 24 the held-out half collapsed onto one pod.
TIERED_KNOBS: dict[str, dict[str, tuple[tuple[float, ...], float]]] = {
    "llmd_weighted": {"prefix_weight": ((1.0, 3.0, 6.0, 12.0, 24.0), 3.0)},
}


def knobs(name: str, tiered: bool = False) -> dict[str, tuple[tuple[float, ...], float]]:
    """Policy ``name``'s tunable constants: (the values --tune tries, the value chosen)."""
    return (TIERED_KNOBS.get(name) if tiered else None) or KNOBS.get(name, {})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="Mooncake JSONL (hash_ids) or Azure CSV")
    parser.add_argument("--max-requests", type=int, help="replay only the first N requests")
    parser.add_argument("--split", choices=SPLITS, default="all",
                        help="tune: the first half of the requests; holdout: the second half")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--prefill-nodes", type=int, default=8)
    parser.add_argument("--decode-nodes", type=int, default=4)
    parser.add_argument("--cache-tokens", type=int, default=3_000_000, help="device KV cache per prefill node")
    parser.add_argument("--host-cache-tokens", type=int, default=0,
                        help="host-memory tier per prefill node, in tokens (0: none)")
    parser.add_argument("--disk-cache-tokens", type=int, default=0, help="disk tier per prefill node, in tokens (0: none)")
    parser.add_argument("--host-gbs", type=float, default=TierTruth().host_bandwidth / 1e9,
                        help="true onboard bandwidth from host memory, GB/s")
    parser.add_argument("--disk-gbs", type=float, default=TierTruth().disk_bandwidth / 1e9,
                        help="true onboard bandwidth from disk, GB/s")
    parser.add_argument("--block-size", type=int, default=512, help="tokens per hash block (Mooncake: 512)")
    parser.add_argument("--load", type=float, default=0.8,
                        help="offered prefill work without cache hits / prefill capacity (arrivals rescaled)")
    parser.add_argument("--speed-spread", type=float, default=SimConfig().speed_spread,
                        help="prefill nodes' true speeds spread over 1 +- spread/2 (the router must learn them)")
    parser.add_argument("--step-noise", type=float, default=SimConfig().step_noise,
                        help="sigma of the log-normal noise on every prefill's true time")
    parser.add_argument("--kv-bytes-per-token", type=int, default=131072)
    parser.add_argument("--bandwidth-gbs", type=float, default=25.0)
    parser.add_argument("--decode-max-batch", type=int, default=128)
    parser.add_argument("--slo-class", choices=sorted(SLO_CLASSES), default="standard")
    parser.add_argument("--admission", choices=ADMISSION_MODES, default="same_for_all",
                        help="same_for_all: one SLO gate in front of every policy; none: nobody rejects")
    parser.add_argument("--no-admission", action="store_true", help="same as --admission none")
    parser.add_argument("--compute-weight", type=float,
                        help=f"pdserve's TtftPolicy.compute_weight (default: the value tuned on {TUNED_ON})")
    parser.add_argument("--tune", action="store_true",
                        help="sweep each tunable policy's constant on this trace/split and report the best")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the TTFT CDF per policy")


def split_requests(requests: list[TraceRequest], split: str) -> list[TraceRequest]:
    """The tuning split is the first half of the requests in arrival order, held out the rest."""
    half = len(requests) // 2
    return {"all": requests, "tune": requests[:half], "holdout": requests[half:]}[split]


def constants(name: str, override: dict | None = None, tiered: bool = False) -> dict:
    """The tuned constants of policy ``name``, with ``override`` on top."""
    return {k: chosen for k, (_, chosen) in knobs(name, tiered).items()} | (override or {})


def make_policy(name: str, cfg: SimConfig, costs: CostBook, override: dict | None = None) -> PlacementPolicy | None:
    """The policy ``name`` with its tuned constants (``override`` replaces some)."""
    c = constants(name, override, cfg.tiered)
    # Peers' approximate trees are sized to a node's cache: all of its tiers (HiCache's L1-L3).
    tree_blocks = cfg.node_cache_tokens // cfg.block_size
    if name in PDSERVE:
        return TtftPolicy(costs, short_prompt_tokens=0, replicate=name == "pdserve", **c)
    if name == "sglang_cache_aware":
        return SglangCacheAware(max_tree_blocks=tree_blocks, **c)
    if name == "llmd_weighted":
        # With tiers, llm-d's precise prefix-cache scorer: the KV-event index and its tier weights.
        return LlmdWeighted(lru_blocks=tree_blocks, tier_weights=LLMD_TIER_WEIGHTS if cfg.tiered else None, **c)
    if name == "global_pool":
        return None
    return BASELINES[name](**c)


def run(args: argparse.Namespace, report) -> dict:
    cfg = SimConfig(
        prefill_nodes=args.prefill_nodes, decode_nodes=args.decode_nodes, cache_tokens=args.cache_tokens,
        host_cache_tokens=args.host_cache_tokens, disk_cache_tokens=args.disk_cache_tokens,
        tiers=TierTruth(host_bandwidth=args.host_gbs * 1e9, disk_bandwidth=args.disk_gbs * 1e9),
        block_size=args.block_size, load=args.load, speed_spread=args.speed_spread, step_noise=args.step_noise,
        kv_bytes_per_token=args.kv_bytes_per_token, bandwidth=args.bandwidth_gbs * 1e9,
        decode_max_batch=args.decode_max_batch, slo_class=args.slo_class,
    )
    admission = "none" if args.no_admission else args.admission
    requests = split_requests(load_trace(args.trace, args.max_requests), args.split)
    scale = time_scale(requests, cfg)
    split_name = f"{os.path.basename(args.trace)}:{args.split}"
    report.progress(f"{len(requests)} requests from {split_name}; arrivals x{scale:.3f} for load {cfg.load}; "
                    f"admission {admission}")
    server = None
    url = args.redis_url
    if url is None:
        server = RedisServer().start()
        url = server.url
    client = redis_client(url, RedisTimeouts(reply_s=30.0))  # bulk deletes of a whole replay's keys
    try:
        def replay(name: str, override: dict | None = None) -> PolicyResult:
            t0 = time.perf_counter()
            costs = CostBook()  # the generic prior, as a router starts; fitted from step reports
            policy = make_policy(name, cfg, costs, override)
            index = _index(client, cfg) if name != "global_pool" else None
            try:
                res = simulate(name, requests, cfg, policy, costs, index, scale=scale, admission=admission,
                               global_pool=name == "global_pool")
            finally:
                if index is not None:
                    _drop(client, index.reader.ns)
            s = res.summary()
            knob = "".join(f" {k}={v}" for k, v in (override or {}).items())
            report.progress(f"{name}{knob}: hit {s['hit_ratio']:.3f}, goodput {s['goodput_rps']:.3f}/s, "
                            f"ttft mean {s['ttft_mean_s']:.2f}s p99 {s['ttft_p99_s']:.2f}s, "
                            f"rejected {res.rejected} ({time.perf_counter() - t0:.1f}s wall)")
            return res

        if args.tune:
            out = _tune(args, replay, report)
        else:
            override = {"compute_weight": args.compute_weight} if args.compute_weight is not None else {}
            overrides = {name: override for name in PDSERVE}
            results = [replay(name, overrides.get(name)) for name in args.policies]
            out = _compare(results, args, overrides, report)
    finally:
        client.close()
        if server is not None:
            server.stop()
    out.update({"trace": args.trace, "split": args.split, "requests": len(requests), "time_scale": scale,
                "admission": admission, "tuned_on": TUNED_ON,
                "config": {"prefill_nodes": cfg.prefill_nodes, "decode_nodes": cfg.decode_nodes,
                           "cache_tokens": cfg.cache_tokens, "host_cache_tokens": cfg.host_cache_tokens,
                           "disk_cache_tokens": cfg.disk_cache_tokens, "host_gbs": cfg.tiers.host_bandwidth / 1e9,
                           "disk_gbs": cfg.tiers.disk_bandwidth / 1e9, "load": cfg.load, "slo_class": cfg.slo_class,
                           "speed_spread": cfg.speed_spread, "step_noise": cfg.step_noise}})
    return out


def _compare(results: list[PolicyResult], args, overrides: dict, report) -> dict:
    n = len(results[0].ttft_s) if results else 0
    common = [all(not math.isnan(r.ttft_s[i]) for r in results) for i in range(n)]
    table = {}
    for r in results:
        s = r.summary(common)
        s["span_s"] = r.span_s
        if constants(r.name):
            s["constant"] = constants(r.name, overrides.get(r.name), _tiered(args))
        table[r.name] = s
    cols = ["hit_ratio", "goodput_rps", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "slo_attainment", "imbalance",
            "rejected", "redis_rtt_per_request", "index_exact_fraction"]
    tiers = ("host", "disk", "remote")
    report.table(["policy", *cols, *[f"{t}_hit_share" for t in tiers]],
                 [[name, *[s[c] for c in cols],
                   *[s["hit_tokens"][t] / max(1, sum(s["hit_tokens"].values())) for t in tiers]]
                  for name, s in table.items()])
    report.progress(f"TTFT statistics over the {sum(common)} of {n} requests every policy served")
    if args.plot:
        _plot(args.plot, results, common)
        report.progress(f"TTFT CDF written to {args.plot}")
    out = {"policies": table, "ttft_requests": sum(common)}
    if "global_pool" in table:
        pool = out["global_pool_hit_ratio"] = table["global_pool"]["hit_ratio"]
        for s in table.values():
            s["hit_vs_global_pool"] = s["hit_ratio"] / pool if pool > 0 else math.nan
    return out


def _tune(args, replay, report) -> dict:
    """Every combination of every tunable policy's constants on this trace/split; the best
    goodput wins, then the lowest mean TTFT over the requests it served."""
    sweep, chosen, rows = {}, {}, []
    for name in args.policies:
        space = knobs(name, _tiered(args))
        if not space:
            continue
        names = list(space)
        runs = []
        for combo in itertools.product(*(space[k][0] for k in names)):
            c = dict(zip(names, combo))
            s = replay(name, c).summary()
            runs.append({"constants": c, "goodput_rps": s["goodput_rps"], "ttft_mean_s": s["ttft_mean_served_s"],
                         "ttft_p99_s": s["ttft_p99_served_s"], "rejected": s["rejected"], "hit_ratio": s["hit_ratio"]})
            rows.append([name, " ".join(f"{k}={v}" for k, v in c.items()), s["goodput_rps"], s["ttft_mean_served_s"],
                         s["ttft_p99_served_s"], s["rejected"], s["hit_ratio"]])
        best = max(runs, key=lambda r: (round(r["goodput_rps"], 4), -r["ttft_mean_s"]))
        sweep[name] = runs
        chosen[name] = best["constants"]
    report.table(["policy", "constants", "goodput_rps", "ttft_mean_s", "ttft_p99_s", "rejected", "hit_ratio"], rows)
    report.progress(f"chosen: {chosen}")
    return {"tuning": sweep, "chosen": chosen}


def _tiered(args: argparse.Namespace) -> bool:
    return args.host_cache_tokens > 0 or args.disk_cache_tokens > 0


def _index(client: redis.Redis, cfg: SimConfig) -> IndexLink:
    ns = f"replay-{uuid.uuid4().hex[:8]}"
    pubs = {}
    for i in range(cfg.prefill_nodes):
        info = NodeInfo(f"prefill-{i}", "prefill", "sim", "sim", cfg.block_size, cfg.cache_tokens // cfg.block_size)
        pubs[info.node_id] = NodePublisher(client, info, ns=ns, lease_s=3600)
        pubs[info.node_id].register()
    return IndexLink(IndexReader(client, ns), pubs)


def _drop(client: redis.Redis, ns: str) -> None:
    keys = list(client.scan_iter(f"{ns}:*", count=10_000))
    for i in range(0, len(keys), 10_000):
        client.delete(*keys[i:i + 10_000])


def _plot(path: str, results: list[PolicyResult], common: list[bool]) -> None:
    with figure(path, dpi=120, figsize=(7, 4.5)) as (_, ax):
        for r in results:
            t = sorted(x for x, c in zip(r.ttft_s, common) if c)
            if t:
                ax.plot(t, [(i + 1) / len(t) for i in range(len(t))], label=r.name,
                        linewidth=2.2 if r.name.startswith("pdserve") else 1.2)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s, simulated; requests every policy served)")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
