"""`pdserve bench router --trace PATH`: replay a real trace through the placement policies.

Every policy runs on the same requests, in simulated time, against one real redis-server
started for the run (or --redis-url): simulated prefill nodes publish their block events through
``NodePublisher``, the router side looks prefixes up through ``IndexReader.match`` (one script
call per request), and pdserve's ``TtftPolicy`` predicts with a ``CostBook`` fitted online from
the simulated nodes' step reports. Baselines (router.replay.baselines) and the global-pool upper bound
run in the same process on the same arrivals. See router/sim.py for the node model.

Columns: token hit ratio; TTFT mean / p50 / p99 (admitted requests); SLO attainment (rejected
requests count as misses); imbalance = max / mean prefill busy time; requests rejected by
admission; Redis round trips per request on the router's path (node-side publishes separately).
"""
from __future__ import annotations

import argparse
import time
import uuid

import redis

from deploy.redis_server import RedisServer
from kv_index.nodes import NodeInfo
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from router.admission import SLO_CLASSES
from router.cost_model import CostBook, DecodeCost, PrefillCost
from router.placement import TtftPolicy
from router.replay.baselines import BASELINES
from router.replay.simulator import IndexLink, SimConfig, simulate, time_scale
from router.replay.traces import load_trace

POLICIES = ("pdserve", "pdserve_replicate", *BASELINES, "global_pool")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="Mooncake JSONL (hash_ids) or Azure CSV")
    parser.add_argument("--max-requests", type=int, help="replay only the first N requests")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--prefill-nodes", type=int, default=8)
    parser.add_argument("--decode-nodes", type=int, default=4)
    parser.add_argument("--cache-tokens", type=int, default=3_000_000, help="KV cache per prefill node")
    parser.add_argument("--block-size", type=int, default=512, help="tokens per hash block (Mooncake: 512)")
    parser.add_argument("--load", type=float, default=0.8,
                        help="offered prefill work without cache hits / prefill capacity (arrivals rescaled)")
    parser.add_argument("--prefill-fixed-s", type=float, default=PrefillCost().fixed_s)
    parser.add_argument("--prefill-per-token-s", type=float, default=PrefillCost().per_token_s)
    parser.add_argument("--prefill-attn-s", type=float, default=PrefillCost().attn_s)
    parser.add_argument("--speed-spread", type=float, default=0.0,
                        help="prefill nodes' true speed differs by up to this fraction (the router must learn it)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=131072)
    parser.add_argument("--bandwidth-gbs", type=float, default=25.0)
    parser.add_argument("--decode-max-batch", type=int, default=128)
    parser.add_argument("--slo-class", choices=sorted(SLO_CLASSES), default="standard")
    parser.add_argument("--no-admission", action="store_true", help="pdserve never rejects")
    parser.add_argument("--compute-weight", type=float, default=1.0,
                        help="pdserve: weight of a request's compute seconds on top of its TTFT (TtftPolicy)")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the TTFT CDF per policy")


def run(args: argparse.Namespace, report) -> dict:
    cfg = SimConfig(
        prefill_nodes=args.prefill_nodes, decode_nodes=args.decode_nodes, cache_tokens=args.cache_tokens,
        block_size=args.block_size, load=args.load,
        prefill_cost=PrefillCost(args.prefill_fixed_s, args.prefill_per_token_s, args.prefill_attn_s),
        decode_cost=DecodeCost(), kv_bytes_per_token=args.kv_bytes_per_token,
        bandwidth=args.bandwidth_gbs * 1e9, decode_max_batch=args.decode_max_batch,
        speed_spread=args.speed_spread, slo_class=args.slo_class,
    )
    requests = load_trace(args.trace, args.max_requests)
    scale = time_scale(requests, cfg)
    report.progress(f"{len(requests)} requests from {args.trace}; arrivals x{scale:.3f} for load {cfg.load}")
    server = None
    url = args.redis_url
    if url is None:
        server = RedisServer().start()
        url = server.url
    client = redis.Redis.from_url(url)
    results = []
    try:
        for name in args.policies:
            t0 = time.perf_counter()
            costs = CostBook(kv_bytes_per_token=cfg.kv_bytes_per_token, default_bandwidth=cfg.bandwidth)
            index = None
            policy = None
            if name != "global_pool":
                index = _index(client, cfg)
                if name.startswith("pdserve"):
                    policy = TtftPolicy(costs, short_prompt_tokens=0, replicate=name == "pdserve_replicate",
                                        compute_weight=args.compute_weight)
                else:
                    policy = BASELINES[name]()
            res = simulate(name, requests, cfg, policy, costs, index, scale=scale,
                           admission=name.startswith("pdserve") and not args.no_admission,
                           global_pool=name == "global_pool")
            if index is not None:
                _drop(client, index.reader.ns)
            results.append(res)
            s = res.summary()
            report.progress(f"{name}: hit {s['hit_ratio']:.3f}, ttft mean {s['ttft_mean_s']:.2f}s "
                            f"p99 {s['ttft_p99_s']:.2f}s ({time.perf_counter() - t0:.1f}s wall)")
    finally:
        client.close()
        if server is not None:
            server.stop()
    table = {r.name: r.summary() for r in results}
    cols = ["hit_ratio", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "slo_attainment", "imbalance", "rejected",
            "redis_rtt_per_request", "index_exact_fraction"]
    report.table(["policy", *cols], [[n, *[s[c] for c in cols]] for n, s in table.items()])
    if args.plot:
        _plot(args.plot, results)
        report.progress(f"TTFT CDF written to {args.plot}")
    out = {"trace": args.trace, "requests": len(requests), "time_scale": scale,
           "config": {"prefill_nodes": cfg.prefill_nodes, "decode_nodes": cfg.decode_nodes,
                      "cache_tokens": cfg.cache_tokens, "load": cfg.load, "slo_class": cfg.slo_class},
           "policies": table}
    if "global_pool" in table:
        out["global_pool_hit_ratio"] = table["global_pool"]["hit_ratio"]
    return out


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


def _plot(path: str, results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        t = sorted(r.ttft_s)
        if t:
            ax.plot(t, [(i + 1) / len(t) for i in range(len(t))], label=r.name,
                    linewidth=2.2 if r.name.startswith("pdserve") else 1.2)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, simulated)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
