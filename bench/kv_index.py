"""`pdserve bench kv-index`: what the global KV-block index costs in Redis memory and lookup time,
with tiers, and what indexing coarser blocks would save.

    pdserve bench kv-index --json                              # 16 nodes x 20k blocks each
    pdserve bench kv-index --nodes 16 --blocks-per-node 100000 --json

A private redis-server (deploy/redis_server.py) is filled the way nodes fill it: each node
resyncs its snapshot in one script call (kv_index/publisher.py). Each node holds conversations:
chains of ``--chain-blocks`` blocks whose first ``--shared-blocks`` are a system prompt every
node shares. Two layouts of the same blocks, measured one after the other on an emptied Redis:

    device    every block in the device tier only (the index before tiers)
    tiered    each chain's head on the device, its middle in host memory, its tail on disk,
              the head kept in host memory too (a block in two tiers: one mask per entry)

and, for the tiered layout, the same chains indexed at coarser granularities (only every g-th
block's hash published: what indexing g x 16-token blocks would store). Per layout:

    bytes_per_entry          (Redis used_memory - empty) / (block, node) entries
    bytes_per_cached_token   the same over the tokens those entries stand for (the compact
                             bucket layout, kv_index/schema.py)
    legacy_bytes_per_cached_token   the same blocks in the layout before it, a key per block
                             (bench/kv_index_legacy.py), on an emptied Redis; ``memory_ratio``
                             = compact / legacy
    lookups_per_s            one client, sequential MATCH calls (kv_index/reader.py) of
                             ``--prompt-blocks``-block prompts with all nodes as candidates,
                             half of them hits of a whole chain, half a random head and a miss
    baseline_lookups_per_s   the same prompts through the legacy layout's lookup, both
                             layouts filled side by side, alternated with the MATCH calls in
                             two rounds; ``lookup_ratio`` = lookups_per_s / baseline_lookups_per_s;
                             ``same_as_legacy``: every prompt got the same leading blocks

``entry_ratio`` = tiered / device bytes per entry (1.0: tiers cost no memory per entry).

The router's local copy (``local``; kv_index/local_index.py, fed by kv_index/event_feed.py):
the tiered chains published the way nodes publish them live (one batch per chain, the copy
following the event stream), then the same prompts as above looked up in process:

    local_lookups_per_s      sequential in-process lookups, one thread; p50 / p99 per lookup
    redis_lookups_per_s      the same prompts through the Redis script in the same run
                             (``local_ratio`` = local / redis)
    identical                lookups whose local answer equals Redis's, of all
    resynced_*               a copy synced from the durable copy alone (a router started after
                             the cluster filled: no chain order known, every block probed),
                             before and after it learned runs from the prompts looked up

and on the replay (``replay``: ``--trace``, its first ``--replay-requests`` requests through
``pdserve bench router``'s simulator and pdserve's policy, every lookup compared after the copy
caught up): ``staleness`` from a node's publish call to the local copy showing its batch, p50 /
p99, at the replay's event rate (the bench's own batches/s beside the trace's, the trace's time
scaled to load 0.8 as in the router bench); ``placement_identical``: every lookup answered the
same (same chains, same answers) and the replay placed on the copy's answers ended exactly as
the replay placed on Redis's. The top-level ``placement_identical`` also needs every layout's
``same_as_legacy``.
"""
from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

from bench import kv_index_legacy as legacy
from bench.kv_index_legacy import LegacyReader
from deploy.redis_server import RedisServer
from kv_index.client import RedisTimeouts, redis_client
from kv_index.event_feed import EventFeed
from kv_index.nodes import NodeInfo
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from kv_index.schema import TIER_DEVICE, TIER_DISK, TIER_HOST, tier_bit
from router.quantiles import upper_rank

_TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces" / "conversation_trace.jsonl"

BLOCK_SIZE = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--blocks-per-node", type=int, default=20_000)
    p.add_argument("--chain-blocks", type=int, default=64, help="blocks per conversation chain")
    p.add_argument("--shared-blocks", type=int, default=8, help="leading blocks every node's chains share")
    p.add_argument("--prompt-blocks", type=int, default=64, help="blocks per looked-up prompt")
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--granularities", default="4,16", help="coarser index steps to measure (blocks per entry)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default=str(_TRACE), help="the replay of the local copy's staleness and placement "
                   "check ('': none)")
    p.add_argument("--replay-requests", type=int, default=1000, help="the replay's first N requests")
    p.add_argument("--redis-cluster", default="", help="also look up on local Redis Clusters of these master "
                   "counts, e.g. 1,3 (bench/kv_index_cluster.py; '': none)")


def chains(args, rng: random.Random) -> list[list[int]]:
    """A node's conversation chains as chained 64-bit hashes (random, as real hashes look); the
    first ``shared_blocks`` of each are the same on every node."""
    shared_rng = random.Random(args.seed - 1)
    shared = [shared_rng.getrandbits(64) for _ in range(args.shared_blocks)]
    own = args.chain_blocks - args.shared_blocks
    n = max(1, (args.blocks_per_node - args.shared_blocks) // own)
    return [shared + [rng.getrandbits(64) for _ in range(own)] for _ in range(n)]


def snapshot(node_chains: list[list[int]], tiered: bool, step: int = 1) -> dict[int, int]:
    """hash -> tier mask. Tiered: the first quarter of each chain on the device and in host
    memory, the next half in host memory, the rest on disk. ``step``: only every step-th block."""
    dev, host, disk = tier_bit(TIER_DEVICE), tier_bit(TIER_HOST), tier_bit(TIER_DISK)
    held: dict[int, int] = {}
    for chain in node_chains:
        n = len(chain)
        for i in range(step - 1, n, step):
            h = chain[i]
            if not tiered:
                mask = dev
            elif i < n // 4:
                mask = dev | host
            elif i < 3 * n // 4:
                mask = host
            else:
                mask = disk
            held[h] = held.get(h, 0) | mask
    return held


def used_memory(r) -> int:
    m = r.info("memory")
    return int(m["used_memory"]) - int(m["used_memory_startup"])


def fill(r, all_chains: list[list[list[int]]], tiered: bool, step: int) -> int:
    """Every node's snapshot resynced; returns the (block, node) entries."""
    entries = 0
    for i, node_chains in enumerate(all_chains):
        info = NodeInfo(f"n{i:02d}", "prefill", f"127.0.0.1:{1000 + i}", "fp", BLOCK_SIZE, 1 << 20)
        pub = NodePublisher(r, info, lease_s=3600)
        held = snapshot(node_chains, tiered, step)
        pub.resync(held)
        entries += len(held)
    return entries


def lookups(r, all_chains, args, rng: random.Random, step: int) -> tuple[float, float, bool]:
    """Lookups per second of the compact layout's MATCH and of the legacy layout's (the
    baseline: bench/kv_index_legacy.py), alternated (A B A B) over the same prompts so that a
    busy machine slows both alike; and whether every prompt got the same leading blocks."""
    reader, legacy = IndexReader(r), LegacyReader(r)
    ids = [f"n{i:02d}" for i in range(len(all_chains))]
    prompts = bench_prompts(all_chains, args, rng, step)
    same = all({n: m.blocks for n, m in reader.match(p, ids).items() if m.blocks} == legacy.match(p, ids)
               for p in prompts)
    spent = [0.0, 0.0]
    for rounds in range(2):
        for which, lookup in enumerate((reader.match, legacy.match)):
            t0 = time.perf_counter()
            for p in prompts[rounds::2]:
                lookup(p, ids)
            spent[which] += time.perf_counter() - t0
    return len(prompts) / spent[0], len(prompts) / spent[1], same


def bench_prompts(all_chains, args, rng: random.Random, step: int = 1) -> list[list[int]]:
    """``--lookups`` prompts of ``--prompt-blocks`` blocks: half a whole chain of some node, half a
    random head of one and then blocks nobody holds (every ``step``-th block's hash)."""
    prompts = []
    for k in range(args.lookups):
        node_chains = all_chains[rng.randrange(len(all_chains))]
        chain = node_chains[rng.randrange(len(node_chains))]
        if k % 2:  # a miss after a random shared head
            prompt = chain[: rng.randrange(1, len(chain))] + [rng.getrandbits(64) for _ in range(args.prompt_blocks)]
        else:
            prompt = chain + [rng.getrandbits(64) for _ in range(args.prompt_blocks)]
        prompts.append(prompt[step - 1 :: step][: max(1, args.prompt_blocks // step)])
    return prompts


def measure(r, all_chains, args, tiered: bool, step: int = 1) -> dict:
    """Memory of each layout on an emptied Redis, then both filled side by side for the lookups."""
    r.flushall()
    base = used_memory(r)
    fill_legacy(r, all_chains, tiered, step)
    legacy_used = used_memory(r) - base
    r.flushall()
    base = used_memory(r)
    entries = fill(r, all_chains, tiered, step)
    used = used_memory(r) - base
    fill_legacy(r, all_chains, tiered, step)
    rate, base_rate, same = lookups(r, all_chains, args, random.Random(args.seed + 1), step)
    tokens = entries * step * BLOCK_SIZE  # an entry stands for step blocks of the chain
    return {"entries": entries, "redis_bytes": used, "bytes_per_entry": round(used / entries, 1),
            "bytes_per_cached_token": round(used / tokens, 2),
            "legacy_redis_bytes": legacy_used, "legacy_bytes_per_cached_token": round(legacy_used / tokens, 2),
            "memory_ratio": round(used / legacy_used, 3), "lookups_per_s": round(rate),
            "baseline_lookups_per_s": round(base_rate), "lookup_ratio": round(rate / base_rate, 3),
            "same_as_legacy": same, "granularity_tokens": step * BLOCK_SIZE}


def fill_legacy(r, all_chains, tiered: bool, step: int) -> None:
    for i, node_chains in enumerate(all_chains):
        info = NodeInfo(f"n{i:02d}", "prefill", f"127.0.0.1:{1000 + i}", "fp", BLOCK_SIZE, 1 << 20)
        legacy.resync(r, info, snapshot(node_chains, tiered, step))


def run(args: argparse.Namespace, report) -> dict:
    rng = random.Random(args.seed)
    all_chains = [chains(args, rng) for _ in range(args.nodes)]
    out: dict = {"nodes": args.nodes, "blocks_per_node": args.blocks_per_node, "prompt_blocks": args.prompt_blocks}
    with RedisServer() as server:
        r = redis_client(server.url, RedisTimeouts(connect_s=2.0, reply_s=120.0))
        report.progress(f"device-only index: {args.nodes} nodes x {args.blocks_per_node} blocks")
        out["device"] = measure(r, all_chains, args, tiered=False)
        report.progress("tiered index (device + host copies, host, disk)")
        out["tiered"] = measure(r, all_chains, args, tiered=True)
        out["coarser"] = []
        for g in (int(x) for x in args.granularities.split(",") if x):
            report.progress(f"tiered index, every {g}th block ({g * BLOCK_SIZE}-token granularity)")
            out["coarser"].append(measure(r, all_chains, args, tiered=True, step=g))
        report.progress("local copy: the tiered chains published batch by batch, followed by the event stream")
        out["local"] = measure_local(r, all_chains, args)
        if args.trace:
            report.progress(f"local copy on the replay: {args.replay_requests} requests of {Path(args.trace).name}")
            out["replay"] = replay(r, args)
        if args.redis_cluster:
            from bench.kv_index_cluster import run_clusters

            out["cluster"] = run_clusters(r, all_chains, args, report)
        r.close()
    out["local_lookups_per_s"] = out["local"]["local_lookups_per_s"]
    out["bytes_per_cached_token"] = out["tiered"]["bytes_per_cached_token"]
    out["legacy_bytes_per_cached_token"] = out["tiered"]["legacy_bytes_per_cached_token"]
    out["memory_ratio"] = out["tiered"]["memory_ratio"]
    out["placement_identical"] = out["local"]["identical"] == out["local"]["lookups"] and (
        "replay" not in out or out["replay"]["placement_identical"]) and all(
        m["same_as_legacy"] for m in [out["device"], out["tiered"], *out["coarser"]]) and all(
        m["placement_identical"] for m in out.get("cluster", []))
    out["entry_ratio"] = round(out["tiered"]["bytes_per_entry"] / out["device"]["bytes_per_entry"], 3)
    rows = [[name, m["granularity_tokens"], m["entries"], m["redis_bytes"] / 2**20, m["bytes_per_entry"],
             m["bytes_per_cached_token"], m["legacy_bytes_per_cached_token"], m["lookups_per_s"],
             m["baseline_lookups_per_s"]]
            for name, m in [("device", out["device"]), ("tiered", out["tiered"])]
            + [(f"tiered/{m['granularity_tokens']}", m) for m in out["coarser"]]]
    report.table(["layout", "tokens/entry", "entries", "MiB", "B/entry", "B/token", "legacy B/token", "lookups/s",
                  "legacy/s"], rows)
    lo = out["local"]
    rows = [["local copy", lo["local_lookups_per_s"], lo["local_p50_us"], lo["local_p99_us"], lo["redis_lookups_per_s"],
             f"{lo['identical']}/{lo['lookups']}"],
            ["resynced, cold", lo["resynced_lookups_per_s"], "", "", "", ""],
            ["resynced, runs learned", lo["resynced_learned_lookups_per_s"], "", "", "", ""]]
    report.table(["lookup", "lookups/s", "p50 us", "p99 us", "redis/s", "same answers"], rows)
    if "replay" in out:
        rp = out["replay"]
        report.table(["replay", "batches", "batches/s (bench)", "batches/s (trace)", "stale p50 ms", "stale p99 ms",
                      "same answers", "placement identical"],
                     [[rp["requests"], rp["batches"], rp["bench_batches_per_s"], rp["trace_batches_per_s"],
                       rp["staleness"]["p50_ms"], rp["staleness"]["p99_ms"], f"{rp['identical']}/{rp['lookups']}",
                       rp["placement_identical"]]])
    return out


def publish_chains(r, all_chains, ns: str = "pdserve") -> int:
    """Every node's chains stored as a live node stores them, one batch per chain (tiered:
    head on the device and in host memory, middle in host memory, tail on disk)."""
    batches = 0
    for i, node_chains in enumerate(all_chains):
        info = NodeInfo(f"n{i:02d}", "prefill", f"127.0.0.1:{1000 + i}", "fp", BLOCK_SIZE, 1 << 20)
        pub = NodePublisher(r, info, ns=ns, lease_s=3600)
        pub.register()
        for chain in node_chains:
            n = len(chain)
            pub.publish(stored={TIER_DEVICE: chain[: n // 4], TIER_HOST: chain[: 3 * n // 4],
                                TIER_DISK: chain[3 * n // 4:]})
            batches += 1
    return batches


def timed(match, prompts, ids) -> tuple[float, list[int]]:
    """Lookups per second of ``match`` over ``prompts`` (a plain loop) and each lookup's ns (a
    second, timed loop)."""
    t0 = time.perf_counter()
    for p in prompts:
        match(p, ids)
    rate = len(prompts) / (time.perf_counter() - t0)
    each = []
    for p in prompts:
        t = time.perf_counter_ns()
        match(p, ids)
        each.append(time.perf_counter_ns() - t)
    return rate, sorted(each)


def measure_local(r, all_chains, args) -> dict:
    r.flushall()
    feed = EventFeed(r, block_s=0.05)
    feed.start()
    try:
        t0 = time.perf_counter()
        batches = publish_chains(r, all_chains)
        if not feed.caught_up(timeout_s=120.0):
            raise RuntimeError("the local copy did not catch up with the event stream")
        fill_s = time.perf_counter() - t0
        reader = IndexReader(r)
        ids = [f"n{i:02d}" for i in range(len(all_chains))]
        prompts = bench_prompts(all_chains, args, random.Random(args.seed + 1))
        same = sum(feed.index.match(p, ids) == reader.match(p, ids) for p in prompts)
        redis_rate, _ = timed(reader.match, prompts[: max(1, len(prompts) // 4)], ids)
        local_rate, each = timed(feed.index.match, prompts, ids)
    finally:
        feed.stop()
    cold = EventFeed(r)  # a router starting now: the snapshot has no chain order
    t0 = time.perf_counter()
    cold.full_sync()
    sync_s = time.perf_counter() - t0
    cold_rate, _ = timed(cold.index.match, prompts, ids)
    for _ in range(10):  # what the feed's thread does between reads, until nothing is left to learn
        if not cold.index.learn_hints():
            break
        for p in prompts:
            cold.index.match(p, ids)
    # Runs learned from these prompts hold their int objects: time equal hashes in new objects,
    # as the next request's would be (an identical object compares faster than an equal one).
    fresh = [[int.from_bytes(h.to_bytes(8, "little"), "little") for h in p] for p in prompts]
    learned_rate, _ = timed(cold.index.match, fresh, ids)
    return {"batches": batches, "fill_s": round(fill_s, 2), "entries": feed.index.entries,
            "lookups": len(prompts), "identical": same,
            "local_lookups_per_s": round(local_rate), "local_p50_us": round(upper_rank(each, 0.5, 0) / 1e3, 1),
            "local_p99_us": round(upper_rank(each, 0.99, 0) / 1e3, 1), "redis_lookups_per_s": round(redis_rate),
            "local_ratio": round(local_rate / redis_rate, 1), "full_sync_s": round(sync_s, 2),
            "resynced_lookups_per_s": round(cold_rate), "resynced_learned_lookups_per_s": round(learned_rate)}


def replay(r, args) -> dict:
    """The router bench's replay twice, placed on Redis's answers then on the local copy's."""
    from bench.router_replay import make_policy
    from router.cost_model import CostBook
    from router.replay.simulator import SimConfig, simulate, time_scale
    from router.replay.traces import load_trace

    requests = load_trace(args.trace, args.replay_requests)
    cfg = SimConfig()  # the router bench's defaults: 8 prefill and 4 decode nodes, 512-token blocks
    scale = time_scale(requests, cfg)
    runs = {}
    for answer in ("redis", "local"):
        r.flushall()
        link = _ComparedLink(r, cfg, answer)
        link.feed.start()
        try:
            costs = CostBook()
            t0 = time.perf_counter()
            res = simulate("pdserve", requests, cfg, make_policy("pdserve", cfg, costs), costs, link, scale=scale)
            runs[answer] = (res, link, time.perf_counter() - t0)
        finally:
            link.feed.stop()
    (res, link, wall_s), (res_local, link_local, _) = runs["redis"], runs["local"]
    stale = sorted(link.stale)
    same_run = (res.cached_tokens == res_local.cached_tokens and res.hit_tokens == res_local.hit_tokens
                and [x if not math.isnan(x) else None for x in res.ttft_s]
                == [x if not math.isnan(x) else None for x in res_local.ttft_s])
    lookups = link.lookups + link_local.lookups
    identical = link.identical + link_local.identical
    return {"requests": len(requests), "batches": len(stale), "lookups": lookups, "identical": identical,
            "bench_batches_per_s": round(len(stale) / wall_s, 1),
            "trace_batches_per_s": round(len(stale) / res.span_s, 2) if res.span_s else None,
            "staleness": {"p50_ms": round(upper_rank(stale, 0.5, math.nan) * 1e3, 3),
                          "p99_ms": round(upper_rank(stale, 0.99, math.nan) * 1e3, 3),
                          "max_ms": round(stale[-1] * 1e3, 3) if stale else None},
            "placement_identical": identical == lookups and same_run, "hit_ratio": round(res.summary()["hit_ratio"], 4)}


class _ComparedLink:
    """The simulator's ``IndexLink`` whose reader answers from Redis (``answer`` "redis") or from
    the local copy ("local"), each lookup compared with the other after the copy caught up, and
    whose publishes are timed until the copy shows them."""

    def __init__(self, r, cfg, answer: str) -> None:
        self.publishers, self.node_round_trips, self.answer = {}, 0, answer
        for i in range(cfg.prefill_nodes):
            info = NodeInfo(f"prefill-{i}", "prefill", "sim", "sim", cfg.block_size, cfg.cache_tokens // cfg.block_size)
            self.publishers[info.node_id] = NodePublisher(r, info, lease_s=3600)
            self.publishers[info.node_id].register()
        self.redis = IndexReader(r)
        self.feed = EventFeed(r, block_s=0.05, on_event=self._shown)
        self.sent: dict[tuple[str, int], float] = {}
        self.stale: list[float] = []
        self.lookups = self.identical = 0
        self.reader = self  # the simulator reads match() and round_trips off .reader

    @property
    def round_trips(self) -> int:
        return self.redis.round_trips

    def publish(self, node_id: str, stored, removed) -> None:
        pub = self.publishers[node_id]
        self.sent[node_id, pub.seq + 1] = time.perf_counter()
        if not pub.publish(stored=stored, removed=removed):
            raise RuntimeError(f"index gap for {node_id}: the simulator publishes every batch in order")
        self.node_round_trips += 1

    def _shown(self, node_id: str, kind: str, seq: int) -> None:  # on the feed's thread
        t = self.sent.pop((node_id, seq), None)
        if kind == "a" and t is not None:
            self.stale.append(time.perf_counter() - t)

    def match(self, hashes, ids):
        if not self.feed.caught_up(timeout_s=30.0):
            raise RuntimeError("the local copy did not catch up with the event stream")
        local, redis_ = self.feed.index.match(hashes, ids), self.redis.match(hashes, ids)
        self.lookups += 1
        self.identical += local == redis_
        return local if self.answer == "local" else redis_
