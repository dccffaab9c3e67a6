"""`pdserve bench router --trace PATH`: replay a real trace through the placement policies.

Every policy runs on the same requests, in simulated time, against one real redis-server
started for the run (or --redis-url): simulated prefill nodes publish their block events through
``NodePublisher``, routers that read the KV-event index look prefixes up through
``IndexReader.match`` (one script call per request), and pdserve's ``TtftPolicy`` predicts with
a ``CostBook`` that starts from the generic prior and is fitted online from the simulated nodes'
step reports. Baselines (router.replay.baselines) and the global-pool upper bound run in the
same process on the same arrivals. See router/replay/simulator.py for the node model.

Equal terms, each admission mode the same rule for every policy (``--admission``, all three by
default; a rejection is an SLO miss): ``none`` is the headline (every policy serves the same
requests); ``queue_bound`` is one policy-neutral gate (a request whose true queue wait on the
node its policy chose exceeds its TTFT budget is rejected); ``pdserve_model``, the gate before
issue 45, is pdserve's cost model judging every policy's choice, kept as a secondary field
(``gated_by_pdserve_model``) because it favours pdserve. Columns: token hit ratio; goodput
(requests whose TTFT met the SLO class budget, per simulated second of the trace); TTFT mean /
p50 / p99 over the requests every policy in the run served; SLO attainment; imbalance = max /
mean prefill busy time; requests rejected; Redis round trips per request on the router's path.

Seeds (``--seeds 0,1,2,3,4``): a seed draws the step noise and the order of the nodes' speeds;
every figure is a mean with a 95% t-interval over the seeds, and the comparisons are per-seed
ratios (bench/router_report.py): ``policy_result``, pdserve_no_fetch against each peer (no
fetch for anyone), and ``capability_result``, pdserve against each peer given a shared tier at
fetch's bandwidth (``PEER+fetch``). ``DEV_SEEDS`` are the seeds the method was developed on;
``--release-seeds N`` draws N fresh ones for figures no choice was made on.

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
``TUNED_ON``, by ``--tune`` (bench/router_tuning.py: the best mean goodput without admission
over the tuning seeds, then the lowest mean TTFT); every other trace and the held-out half are
reported with them unchanged, with a check that each sits inside its grid (``tuning_check``).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import secrets
import time
import uuid

import redis

from bench.plotting import figure
from bench.router_replicas import compare_replicas, router_counts, spread_arrivals
from bench.router_report import FETCH, FETCH_PEERS, SECTIONS, print_section, section
from bench.router_tuning import TUNED_ON, TUNING_SEEDS, check_all, constants, knobs, sweep
from deploy.redis_server import RedisServer
from kv_index.client import RedisTimeouts, redis_client
from kv_index.nodes import NodeInfo
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from kv_index.schema import tag
from router.admission import SLO_CLASSES
from router.config import RouterConfig
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
POLICIES = (*PDSERVE, *BASELINES, "global_pool", *FETCH_PEERS)
SPLITS = ("all", "tune", "holdout")
# The seeds the method, the grids and the constants were developed and checked on (issue 45):
# figures on them are development figures; `--release-seeds N` draws fresh ones.
DEV_SEEDS = (0, 1, 2, 3, 4)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="Mooncake JSONL (hash_ids) or Azure CSV")
    parser.add_argument("--max-requests", type=int, help="replay only the first N requests")
    parser.add_argument("--split", choices=SPLITS, default="all",
                        help="tune: the first half of the requests; holdout: the second half")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--seeds", "--seed", type=_seed_list, metavar="S[,S...]",
                        help=f"seeds to replay (default: the development seeds {','.join(map(str, DEV_SEEDS))}; "
                             f"with --tune {','.join(map(str, TUNING_SEEDS))})")
    parser.add_argument("--release-seeds", type=int, metavar="N",
                        help="draw N fresh seeds (reported in the JSON) instead of --seeds")
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
    parser.add_argument("--admission", nargs="+", choices=ADMISSION_MODES, default=list(ADMISSION_MODES),
                        help="none: nobody rejects (the headline); queue_bound: one policy-neutral queue bound; "
                             "pdserve_model: pdserve's model gates every policy (secondary)")
    parser.add_argument("--no-admission", action="store_true", help="same as --admission none")
    parser.add_argument("--gate-queue-fraction", type=float, default=SimConfig().gate_queue_fraction,
                        help="queue_bound rejects a request whose true queue wait exceeds this x its TTFT budget")
    parser.add_argument("--compute-weight", type=float,
                        help=f"pdserve's TtftPolicy.compute_weight (default: the value tuned on {TUNED_ON})")
    parser.add_argument("--tune", action="store_true",
                        help="sweep each tunable policy's grid on this trace/split (the first admission mode)")
    parser.add_argument("--routers", type=router_counts, metavar="N[,N...]",
                        help="pdserve with N router replicas against one, their ledgers shared every --share-s "
                             "and not at all (bench/router_replicas.py); replaces the policy comparison")
    parser.add_argument("--share-s", type=float, default=RouterConfig.__dataclass_fields__["node_refresh_s"].default,
                        help="--routers: how often replicas see each other's load (the node view's refresh)")
    parser.add_argument("--spread-arrivals", type=float, default=0.0, metavar="S",
                        help="--routers: move each arrival by a uniform draw within S seconds of trace time "
                             "(the Mooncake traces stamp arrivals in 3 s buckets; 0: as recorded)")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the TTFT CDF per policy (first seed, first mode)")


def _seed_list(text: str) -> tuple[int, ...]:
    seeds = tuple(int(x) for x in text.split(",") if x.strip())
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"want distinct comma-separated integers, got {text!r}")
    return seeds


def split_requests(requests: list[TraceRequest], split: str) -> list[TraceRequest]:
    """The tuning split is the first half of the requests in arrival order, held out the rest."""
    half = len(requests) // 2
    return {"all": requests, "tune": requests[:half], "holdout": requests[half:]}[split]


def make_policy(name: str, cfg: SimConfig, costs: CostBook, override: dict | None = None) -> PlacementPolicy | None:
    """The policy ``name`` with its tuned constants (``override`` replaces some); a ``+fetch``
    variant is its base policy (the simulator adds the shared tier)."""
    name = name.removesuffix(FETCH)
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


def sim_config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        prefill_nodes=args.prefill_nodes, decode_nodes=args.decode_nodes, cache_tokens=args.cache_tokens,
        host_cache_tokens=args.host_cache_tokens, disk_cache_tokens=args.disk_cache_tokens,
        tiers=TierTruth(host_bandwidth=args.host_gbs * 1e9, disk_bandwidth=args.disk_gbs * 1e9),
        block_size=args.block_size, load=args.load, speed_spread=args.speed_spread, step_noise=args.step_noise,
        kv_bytes_per_token=args.kv_bytes_per_token, bandwidth=args.bandwidth_gbs * 1e9,
        decode_max_batch=args.decode_max_batch, slo_class=args.slo_class,
        gate_queue_fraction=args.gate_queue_fraction,
    )


def choose_seeds(args: argparse.Namespace) -> tuple[tuple[int, ...], str]:
    """The seeds to replay and their role: ``release`` when none was used in development."""
    if args.release_seeds:
        seeds = tuple(sorted({secrets.randbelow(2**31 - 1) + 1 for _ in range(args.release_seeds)}))
    else:
        seeds = args.seeds or (TUNING_SEEDS if args.tune else DEV_SEEDS)
    role = "development" if set(seeds) & {*DEV_SEEDS, *TUNING_SEEDS} else "release"
    return seeds, role


class Replayer:
    """One policy's replay at a time, on one trace, against one Redis."""

    def __init__(self, client: redis.Redis, cfg: SimConfig, requests: list[TraceRequest], scale: float,
                 report) -> None:
        self.client, self.cfg, self.requests, self.scale, self.report = client, cfg, requests, scale, report

    def __call__(self, name: str, admission: str, seed: int, override: dict | None = None, *, routers: int = 1,
                 share_s: float | None = None) -> PolicyResult:
        t0 = time.perf_counter()
        cfg = dataclasses.replace(self.cfg, seed=seed)
        costs = CostBook()  # the generic prior, as a router starts; fitted from step reports
        policy = make_policy(name, cfg, costs, override)
        index = _index(self.client, cfg) if name != "global_pool" else None
        try:
            res = simulate(name, self.requests, cfg, policy, costs, index, scale=self.scale, admission=admission,
                           global_pool=name == "global_pool", shared_fetch=name.endswith(FETCH), routers=routers,
                           share_s=share_s)
        finally:
            if index is not None:
                _drop(self.client, index.reader.ns)
        s = res.summary()
        knob = "".join(f" {k}={v}" for k, v in (override or {}).items())
        if routers > 1:
            knob += f" routers={routers} " + (f"shared every {share_s} s" if share_s is not None else "unshared")
        self.report.progress(f"seed {seed} {admission} {name}{knob}: hit {s['hit_ratio']:.3f}, goodput "
                             f"{s['goodput_rps']:.3f}/s, ttft mean {s['ttft_mean_s']:.2f}s p99 {s['ttft_p99_s']:.2f}s, "
                             f"rejected {res.rejected} ({time.perf_counter() - t0:.1f}s wall)")
        return res


def run(args: argparse.Namespace, report) -> dict:
    cfg = sim_config(args)
    modes = ["none"] if args.no_admission else [m for m in ADMISSION_MODES if m in args.admission]
    seeds, role = choose_seeds(args)
    requests = split_requests(load_trace(args.trace, args.max_requests), args.split)
    if args.routers and args.spread_arrivals > 0:
        requests = spread_arrivals(requests, args.spread_arrivals)
    scale = time_scale(requests, cfg)
    report.progress(f"{len(requests)} requests from {os.path.basename(args.trace)}:{args.split}; arrivals "
                    f"x{scale:.3f} for load {cfg.load}; admission {' '.join(modes)}; seeds {seeds} ({role})")
    server = None
    url = args.redis_url
    if url is None:
        server = RedisServer().start()
        url = server.url
    client = redis_client(url, RedisTimeouts(reply_s=30.0))  # bulk deletes of a whole replay's keys
    try:
        replay = Replayer(client, cfg, requests, scale, report)
        if args.routers:
            out = {"replicas": {mode: compare_replicas(replay, mode, seeds, args.routers, args.share_s, report)
                                for mode in modes}}
            out["passed"] = all(r["passed"] for r in out["replicas"].values())
        elif args.tune:
            out = sweep(args.policies, cfg.tiered, seeds, lambda n, c, seed: _swept(replay(n, modes[0], seed, c)),
                        report)
        else:
            out = compare_seeds(args, replay, modes, seeds, report)
    finally:
        client.close()
        if server is not None:
            server.stop()
    out.update({"trace": args.trace, "split": args.split, "requests": len(requests), "time_scale": scale,
                "admission": modes, "seeds": list(seeds), "seed_role": role, "tuned_on": TUNED_ON,
                "spread_arrivals_s": args.spread_arrivals if args.routers else 0.0,
                "config": {"prefill_nodes": cfg.prefill_nodes, "decode_nodes": cfg.decode_nodes,
                           "cache_tokens": cfg.cache_tokens, "host_cache_tokens": cfg.host_cache_tokens,
                           "disk_cache_tokens": cfg.disk_cache_tokens, "host_gbs": cfg.tiers.host_bandwidth / 1e9,
                           "disk_gbs": cfg.tiers.disk_bandwidth / 1e9, "load": cfg.load, "slo_class": cfg.slo_class,
                           "speed_spread": cfg.speed_spread, "step_noise": cfg.step_noise,
                           "gate_queue_fraction": cfg.gate_queue_fraction}})
    return out


def compare_seeds(args, replay: Replayer, modes: list[str], seeds, report) -> dict:
    """Every policy, every admission mode, every seed; then each mode's section over the seeds.
    The pdserve-model gate runs without the ``+fetch`` variants (its estimate knows no shared tier)."""
    override = {"compute_weight": args.compute_weight} if args.compute_weight is not None else {}
    overrides = {name: override for name in PDSERVE}
    tiered = _tiered(args)
    per_seed: dict[str, dict[str, dict]] = {}
    for mode in modes:
        names = [n for n in args.policies if mode != "pdserve_model" or not n.endswith(FETCH)]
        for seed in seeds:
            results = [replay(name, mode, seed, overrides.get(name)) for name in names]
            per_seed.setdefault(mode, {})[str(seed)] = compare(results, overrides, tiered)
            if args.plot and mode == modes[0] and seed == seeds[0]:
                _plot(args.plot, results, _common(results))
                report.progress(f"TTFT CDF written to {args.plot}")
    out: dict = {"per_seed": per_seed}
    for mode in modes:
        sec = out[SECTIONS[mode]] = section(mode, [t["policies"] for t in per_seed[mode].values()])
        print_section(report, SECTIONS[mode], sec)
    out["tuning_check"] = check_all(args.policies, tiered)
    out["all_interior"] = all(c["interior"] for c in out["tuning_check"].values())
    return out


def compare(results: list[PolicyResult], overrides: dict, tiered: bool) -> dict:
    """One seed, one mode: every policy's summary over the requests all of them served."""
    common = _common(results)
    table = {}
    for r in results:
        s = r.summary(common)
        s["span_s"] = r.span_s
        if knobs(r.name):
            s["constant"] = constants(r.name, overrides.get(r.name), tiered)
        table[r.name] = s
    out = {"policies": table, "ttft_requests": sum(common)}
    if "global_pool" in table:
        pool = out["global_pool_hit_ratio"] = table["global_pool"]["hit_ratio"]
        for s in table.values():
            s["hit_vs_global_pool"] = s["hit_ratio"] / pool if pool > 0 else math.nan
    return out


def _common(results: list[PolicyResult]) -> list[bool]:
    n = len(results[0].ttft_s) if results else 0
    return [all(not math.isnan(r.ttft_s[i]) for r in results) for i in range(n)]


def _swept(res: PolicyResult) -> dict:
    s = res.summary()
    return {"goodput_rps": s["goodput_rps"], "ttft_mean_s": s["ttft_mean_served_s"],
            "ttft_p99_s": s["ttft_p99_served_s"], "rejected": s["rejected"], "hit_ratio": s["hit_ratio"]}


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
    keys = list(client.scan_iter(f"{tag(ns)}:*", count=10_000))
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
