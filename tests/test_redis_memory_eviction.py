"""A Redis that fills up (issue 49): the KV index shares Redis with the node registry, the
planner's state and (in the chart) Ray's GCS tables, under a memory limit. The project's Redis
(deploy/redis_server.py) runs maxmemory with volatile-lfu, and among what grows only the index's
block keys carry a TTL (kv_index/schema.py INDEX_TTL_S); leases have one too but are touched at
every heartbeat. A real redis-server with a 4 MiB maxmemory and two real publishers whose caches
together outgrow it (each stores and evicts blocks, as a node does): the index evicts, every
write still succeeds, the registry, the planner's keys and a GCS-like table survive, the nodes'
block SETs stay the size of what they hold, and the router's lookup sees what was evicted as
misses while a prefix it keeps asking for stays."""
from __future__ import annotations

from collections import deque

import redis

from deploy.redis_server import MAXMEMORY_POLICY, RedisServer
from kv_index.client import redis_client
from kv_index.nodes import NodeInfo, Role
from kv_index.plan import PlanStore
from kv_index.pool_targets import PoolTargets
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from kv_index.roles import RoleStore
from kv_index.schema import INDEX_TTL_S, block_key, node_blocks_key, node_key

NS = "full"
BATCH = 500  # blocks stored (and as many evicted) per event batch, as a busy node publishes
HOLD = 8000  # blocks each node's cache holds: two of them outgrow the 4 MiB Redis
NODES = ("prefill-0", "decode-0")


def _used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def test_a_full_redis_evicts_only_the_index():
    with RedisServer(maxmemory_mib=4) as server:
        r = redis_client(server.url)
        assert r.config_get("maxmemory-policy")["maxmemory-policy"] == MAXMEMORY_POLICY == "volatile-lfu"
        limit = int(r.config_get("maxmemory")["maxmemory"])
        assert limit == 4 << 20
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

        # A prefix every request asks for (a system prompt), then the caches' churn.
        hot = list(range(1, 65))
        assert pubs["prefill-0"].publish(stored=hot)
        # Only the index's blocks (and leases that heartbeats touch) may be evicted.
        assert 0 < r.pttl(block_key(NS, 1)) <= INDEX_TTL_S * 1000
        for key in (gcs, f"{NS}:plan", f"{NS}:role:desired", f"{NS}:nodes", node_blocks_key(NS, "prefill-0")):
            assert r.pttl(key) == -1, key  # no TTL: never evicted
        reader = IndexReader(r, NS)
        held = {nid: deque() for nid in NODES}
        first: list[int] = []
        h = 1 << 32
        for rnd in range(3 * 2 * HOLD // BATCH):
            for pub in pubs.values():  # what nodes and the planner do all along
                assert pub.heartbeat({"free_blocks": 1}), "a lease was lost"
            assert plan.lead("router-a", lease_s=30)
            for _ in range(20):  # the requests of a round, each looking the prefix up
                assert reader.match(hot, ["prefill-0"])["prefill-0"].blocks > 0
            nid = NODES[rnd % 2]
            new = list(range(h, h + BATCH))
            h += BATCH
            gone = [held[nid].popleft() for _ in range(max(0, len(held[nid]) + BATCH - HOLD))]
            assert pubs[nid].publish(stored=new, removed=gone)  # past the limit, writes still succeed
            held[nid].extend(new)
            first = first or new
        assert r.info("stats")["evicted_keys"] > 0
        assert _used(r) <= limit * 1.1  # held at the limit (a script may pass it until the next command)

        # Everything that is not the index is intact.
        assert set(reader.live_nodes()) == set(NODES) and reader.prune_dead() == []
        assert all(r.hget(node_key(NS, nid), "grpc") for nid in NODES)
        assert plan.leader() is not None and plan.read()["mode"] == "active"
        assert targets.get() == {Role.PREFILL: 1, Role.DECODE: 1}
        assert roles.desired("prefill-0") is Role.DECODE
        assert r.hlen(gcs) == 200
        # A node's SET is what it holds, however many of its blocks' entries were evicted.
        assert r.scard(node_blocks_key(NS, "decode-0")) == len(held["decode-0"])

        # The index lost entries of what the caches hold, which the router's lookup sees as
        # shorter prefixes (misses); the prefix asked for all along is whole.
        present = sum(r.exists(*[block_key(NS, x) for x in list(held[n])[i:i + 500]])
                      for n in NODES for i in range(0, HOLD, 500))
        assert 0 < present < 2 * HOLD
        chain = list(held["decode-0"])
        assert reader.match(chain, ["decode-0"])["decode-0"].blocks < len(chain)
        assert reader.match(hot, ["prefill-0"])["prefill-0"].blocks == len(hot)
        assert not r.exists(*[block_key(NS, x) for x in first])  # long gone from both: removed
        r.close()
