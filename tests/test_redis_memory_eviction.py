"""A Redis that fills up (issue 49): the KV index shares Redis with the node registry, the
planner's state and (in the chart) Ray's GCS tables, under a memory limit. The project's Redis
(deploy/redis_server.py) runs maxmemory with volatile-lfu, and among what grows only the index's
bucket keys carry a TTL (kv_index/schema.py INDEX_TTL_S); leases are a field on Redis's clock, no
TTL. A real redis-server with a 4 MiB maxmemory and two real publishers whose caches
together outgrow it (each stores and evicts blocks, as a node does): the index evicts, every
write still succeeds, the registry, the leases, the planner's keys and a GCS-like table survive,
a node's entries are a subset of what it holds, and the router's lookup sees what was evicted as
misses while a prefix it keeps asking for stays."""
from __future__ import annotations

from collections import deque

import redis

from deploy.redis_server import MAXMEMORY_POLICY, RedisServer
from kv_index.client import RedisTimeouts, redis_client
from kv_index.nodes import NodeInfo, Role
from kv_index.plan import PlanStore, plan_key
from kv_index.pool_targets import PoolTargets
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from kv_index.roles import RoleStore, desired_key
from kv_index.schema import INDEX_TTL_S, bucket_key, bucket_of, node_holdings, node_key, nodes_key, slots_key

NS = "full"
BATCH = 500  # blocks stored (and as many evicted) per event batch, as a busy node publishes
ROUNDS = 40  # batches, both nodes together: the event stream (no TTL) stays well under the limit
HOLD = 80000  # blocks each node's cache holds (its snapshot, resynced first): two outgrow the 4 MiB Redis
MIB = 4


def bh(x: int) -> int:
    """A block hash for ``x``: spread over the 64 bits as real chained hashes are."""
    return (x * 0x9E3779B97F4A7C15) & (2**64 - 1)
NODES = ("prefill-0", "decode-0")


def _used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def test_a_full_redis_evicts_only_the_index():
    with RedisServer(maxmemory_mib=MIB) as server:
        r = redis_client(server.url, RedisTimeouts(reply_s=30.0))  # an 80k-block resync is one script call
        assert r.config_get("maxmemory-policy")["maxmemory-policy"] == MAXMEMORY_POLICY == "volatile-lfu"
        limit = int(r.config_get("maxmemory")["maxmemory"])
        assert limit == MIB << 20
        pubs = {}
        for i, nid in enumerate(NODES):
            info = NodeInfo(node_id=nid, role=Role.PREFILL if i == 0 else Role.DECODE,
                            grpc_address=f"127.0.0.1:{i + 1}", fingerprint="f", block_size=16, num_blocks=HOLD)
            pubs[nid] = NodePublisher(r, info, ns=NS, lease_s=30)
            pubs[nid].register()
        plan, targets, roles = PlanStore(r, NS), PoolTargets(r, NS), RoleStore(r, NS)
        plan.publish({"mode": "active", "layout": {"prefill": 1, "decode": 1}})
        targets.set({Role.PREFILL: 1, Role.DECODE: 1}, "test")
        roles.request("prefill-0", Role.DECODE, "test")
        gcs = "RAY_test@NODE_TABLE"  # as Ray's GCS keeps a table: a HASH, no TTL
        r.hset(gcs, mapping={f"node-{i}": "x" * 1000 for i in range(200)})

        # Full caches, a prefix every request asks for (a system prompt), then the caches' churn.
        held = {nid: deque(bh(x) for x in range(i * HOLD + 1000, (i + 1) * HOLD + 1000)) for i, nid in enumerate(NODES)}
        first = list(held[NODES[0]])[:BATCH]  # the first blocks the churn removes
        hot = [bh(x) for x in range(1, 65)]
        pubs["prefill-0"].resync([*hot, *held["prefill-0"]])
        reader = IndexReader(r, NS)
        for _ in range(300):  # the prefix was asked for long before Redis filled up
            assert reader.match(hot, ["prefill-0"])["prefill-0"].blocks == len(hot)
        pubs["decode-0"].resync(held["decode-0"])  # past the limit
        # Only the index's buckets may be evicted.
        assert 0 < r.pttl(bucket_key(NS, bucket_of(hot[0]))) <= INDEX_TTL_S * 1000
        for key in (gcs, plan_key(NS), desired_key(NS), nodes_key(NS), slots_key(NS), node_key(NS, "prefill-0")):
            assert r.pttl(key) == -1, key  # no TTL: never evicted
        h = 1 << 32
        for rnd in range(ROUNDS):
            for pub in pubs.values():  # what nodes and the planner do all along
                assert pub.heartbeat({"free_blocks": 1}), "a lease was lost"
            assert plan.lead("router-a", lease_s=30)
            for _ in range(20):  # the requests of a round, each looking the prefix up
                assert reader.match(hot, ["prefill-0"])["prefill-0"].blocks > 0
            nid = NODES[rnd % 2]
            new = [bh(x) for x in range(h, h + BATCH)]
            h += BATCH
            gone = [held[nid].popleft() for _ in range(max(0, len(held[nid]) + BATCH - HOLD))]
            assert pubs[nid].publish(stored=new, removed=gone)  # past the limit, writes still succeed
            held[nid].extend(new)
        assert r.info("stats")["evicted_keys"] > 0
        assert _used(r) <= limit * 1.1  # held at the limit (a script may pass it until the next command)

        # Everything that is not the index is intact.
        assert set(reader.live_nodes()) == set(NODES) and reader.prune_dead() == []
        assert all(r.hget(node_key(NS, nid), "grpc") for nid in NODES)
        assert plan.leader() is not None and plan.read()["mode"] == "active"
        assert targets.get() == {Role.PREFILL: 1, Role.DECODE: 1}
        assert roles.desired("prefill-0") is Role.DECODE
        assert r.hlen(gcs) == 200
        # The index lost entries of what the caches hold, never kept one they dropped, which the
        # router's lookup sees as shorter prefixes (misses); the prefix asked for all along is whole.
        indexed = {n: node_holdings(r, NS, n)[2] for n in NODES}
        for n in NODES:
            assert set(indexed[n]) <= set(held[n]) | (set(hot) if n == "prefill-0" else set())
        present = sum(len(set(indexed[n]) & set(held[n])) for n in NODES)
        assert 0 < present < 2 * HOLD
        chain = list(held["decode-0"])
        assert reader.match(chain, ["decode-0"])["decode-0"].blocks < len(chain)
        assert reader.match(hot, ["prefill-0"])["prefill-0"].blocks == len(hot)
        assert not set(first) & set(indexed[NODES[0]])  # long gone from the cache: removed
        r.close()
