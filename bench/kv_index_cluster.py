"""`pdserve bench kv-index --redis-cluster 1,3`: the index's lookups on a local Redis Cluster of
each size (deploy/redis_cluster.py: N masters, a replica each), beside `bench kv-index`'s one
redis-server.

Per cluster size: the tiered chains of `bench kv-index` resynced as nodes resync them, then its
prompts looked up through a ``redis+cluster://`` client (kv_index/reader.py, one MATCH call
each), one client, sequential:

    lookups_per_s, p50_ms, p99_ms   the lookup rate and per-lookup latency
    shard_spread                    per master, its share of the lookup calls (INFO commandstats'
                                    evalsha calls, counted from a CONFIG RESETSTAT before them)
    service_us                      the index master's time per call (commandstats' usec_per_call):
                                    what one shard spends per lookup, the bound on its rate
    placement_identical             every prompt's answer equals the one redis-server's

Every index key carries the namespace's hash tag (kv_index/schema.py), so every script's keys
sit in one slot: one namespace's index lives on one master whatever the cluster's size, and the
spread shows it. More masters serve more namespaces (clusters), not one faster.
"""
from __future__ import annotations

import random
import time

from kv_index.client import RedisTimeouts, redis_client
from kv_index.reader import IndexReader
from router.quantiles import upper_rank


def measure_cluster(masters: int, all_chains, args, prompts, ids, want: list) -> dict:
    from bench.kv_index import fill
    from deploy.redis_cluster import RedisClusterServer
    from kv_index.schema import nodes_key

    with RedisClusterServer(masters=masters, replicas=1, node_timeout_ms=5000) as rc:
        r = redis_client(rc.url, RedisTimeouts(connect_s=2.0, reply_s=120.0))
        fill(r, all_chains, tiered=True, step=1)
        reader = IndexReader(r)
        same = [reader.match(p, ids) for p in prompts] == want
        masters_now = rc.nodes[:masters]
        for n in masters_now:  # the lookups' own counts and times, not the fill's
            c = rc.admin(n)
            c.config_resetstat()
            c.close()
        t0 = time.perf_counter()
        each = []
        for p in prompts:
            t = time.perf_counter_ns()
            reader.match(p, ids)
            each.append(time.perf_counter_ns() - t)
        rate = len(prompts) / (time.perf_counter() - t0)
        after = [_evalsha(rc, n) for n in masters_now]
        calls = [a[0] for a in after]
        total = sum(calls) or 1
        home = rc.master_for(nodes_key("pdserve"))
        r.close()
        each.sort()
        return {"masters": masters, "lookups": len(prompts), "lookups_per_s": round(rate),
                "p50_ms": round(upper_rank(each, 0.5, 0) / 1e6, 3), "p99_ms": round(upper_rank(each, 0.99, 0) / 1e6, 3),
                "shard_spread": [round(c / total, 3) for c in calls],
                "service_us": next((a[1] for n, a in zip(masters_now, after) if n is home), None),
                "placement_identical": same}


def _evalsha(rc, node) -> tuple[int, float]:
    """(evalsha calls, usec per call) of one node."""
    c = rc.admin(node)
    try:
        stats = c.info("commandstats").get("cmdstat_evalsha", {})
        return int(stats.get("calls", 0)), float(stats.get("usec_per_call", 0.0))
    finally:
        c.close()


def run_clusters(r, all_chains, args, report) -> list[dict]:
    """Each size of ``--redis-cluster`` against the one redis-server ``r`` (filled here)."""
    from bench.kv_index import bench_prompts, fill

    sizes = [int(x) for x in args.redis_cluster.split(",") if x]
    r.flushall()
    fill(r, all_chains, tiered=True, step=1)
    ids = [f"n{i:02d}" for i in range(len(all_chains))]
    prompts = bench_prompts(all_chains, args, random.Random(args.seed + 2))
    one = IndexReader(r)
    want = [one.match(p, ids) for p in prompts]
    t0 = time.perf_counter()
    each = []
    for p in prompts:
        t = time.perf_counter_ns()
        one.match(p, ids)
        each.append(time.perf_counter_ns() - t)
    rate = len(prompts) / (time.perf_counter() - t0)
    each.sort()
    out = [{"masters": 0, "lookups": len(prompts), "lookups_per_s": round(rate),
            "p50_ms": round(upper_rank(each, 0.5, 0) / 1e6, 3), "p99_ms": round(upper_rank(each, 0.99, 0) / 1e6, 3),
            "shard_spread": [1.0], "service_us": None, "placement_identical": True}]
    for n in sizes:
        report.progress(f"Redis Cluster of {n} master(s), a replica each: fill and {len(prompts)} lookups")
        out.append(measure_cluster(n, all_chains, args, prompts, ids, want))
    report.table(["masters (0: one redis-server)", "lookups/s", "p50 ms", "p99 ms", "spread", "service us", "same"],
                 [[m["masters"], m["lookups_per_s"], m["p50_ms"], m["p99_ms"], " ".join(map(str, m["shard_spread"])),
                   m["service_us"], m["placement_identical"]] for m in out])
    return out
