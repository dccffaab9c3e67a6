"""The KV index on a real Redis Cluster (issue 48): 3 masters and a replica each on loopback
(deploy/redis_cluster.py), reached through a ``redis+cluster://`` URL. The index works as on
one Redis (publish, lookup, the routers' local copy fed by the event stream); a master frozen
(SIGSTOP) makes lookups fail fast and the router say ``degraded``, and after SIGCONT they answer
again; a master killed (SIGKILL) is failed over to its replica and lookups come back, never
with a wrong answer (a block the index lost is a miss, a shorter prefix)."""
from __future__ import annotations

import uuid

import pytest
import redis

from deploy.redis_cluster import RedisClusterServer
from deploy.status import index_size
from kv_index.client import RedisTimeouts, is_cluster_url, redis_client
from kv_index.event_feed import EventFeed
from kv_index.nodes import NodeInfo
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from kv_index.schema import TIER_HOST, nodes_key
from router.index_guard import GuardedLookup, LookupBreaker
from tests.helpers import wait_for

TIMEOUTS = RedisTimeouts(connect_s=0.5, reply_s=0.5)


@pytest.fixture(scope="module")
def cluster():
    with RedisClusterServer(masters=3, replicas=1, node_timeout_ms=1000) as rc:
        yield rc


def bh(x: int) -> int:
    return (x * 0x9E3779B97F4A7C15) & (2**64 - 1)


def fill(r, ns: str) -> tuple[dict[str, list[int]], IndexReader]:
    chains = {"a": [bh(i) for i in range(1, 41)], "b": [bh(i) for i in range(1, 11)] + [bh(i) for i in range(500, 520)]}
    for nid, chain in chains.items():
        pub = NodePublisher(r, NodeInfo(nid, "prefill", "127.0.0.1:1", "fp", 16, 1000), ns=ns, lease_s=3600)
        pub.register()
        assert pub.publish(stored={0: chain[:20], TIER_HOST: chain[10:]})
    return chains, IndexReader(r, ns)


def never_wrong(got, chains, prompt) -> bool:
    """Each node's match is at most its true leading blocks (a lost entry: a miss)."""
    for nid, chain in chains.items():
        true = next((i for i, (x, y) in enumerate(zip(prompt, chain)) if x != y), min(len(prompt), len(chain)))
        if got.get(nid) is not None and got[nid].blocks > true:
            return False
    return True


def in_sync(rc: RedisClusterServer, master) -> bool:
    """Every write the master took has reached its replica."""
    c = rc.admin(master)
    try:
        info = c.info("replication")
        return info.get("connected_slaves", 0) >= 1 and info["slave0"]["offset"] >= info["master_repl_offset"]
    finally:
        c.close()


def test_the_index_and_its_local_copy_work_on_a_cluster(cluster):
    assert is_cluster_url(cluster.url)
    r = redis_client(cluster.url, TIMEOUTS)
    ns = f"c-{uuid.uuid4().hex[:6]}"
    chains, reader = fill(r, ns)
    got = reader.match(chains["a"], ["a", "b"])
    assert got["a"].blocks == 40 and got["a"].host == 20 and got["b"].blocks == 10
    assert set(reader.live_nodes()) == {"a", "b"}
    size = index_size(r, ns, reader.live_nodes())  # `pdserve status`'s index figures
    assert size["blocks"] == len(set(chains["a"]) | set(chains["b"])) and size["entries"] == {"a": 40, "b": 30}
    feed = EventFeed(r, ns, block_s=0.05)
    feed.full_sync()
    more = NodePublisher(r, NodeInfo("c", "decode", "127.0.0.1:2", "fp", 16, 1000), ns=ns, lease_s=3600)
    more.register()
    assert more.publish(stored=chains["b"])
    feed.step()
    feed.step()
    for p in (chains["a"], chains["b"], chains["a"][:5]):
        assert feed.index.match(p, ["a", "b", "c"]) == reader.match(p, ["a", "b", "c"])
    r.close()


def test_a_frozen_master_degrades_lookups_until_it_resumes(cluster):
    r = redis_client(cluster.url, TIMEOUTS)
    ns = f"s-{uuid.uuid4().hex[:6]}"
    chains, reader = fill(r, ns)
    lookup = GuardedLookup(reader, LookupBreaker(base_s=0.05, max_s=0.2))
    prompt = chains["a"]
    assert lookup.match(prompt, ["a", "b"])["a"].blocks == 40
    master = cluster.master_for(nodes_key(ns))
    with master.frozen():
        assert lookup.match(prompt, ["a", "b"]) == {}  # timed out: placed by load
        assert lookup.degraded is not None and lookup.failures == 1
    # Resumed (or, had the freeze outlived the node timeout, failed over): the probe closes the
    # breaker and the index answers, right, again.
    assert wait_for(lambda: lookup.probe() is not False and lookup.match(prompt, ["a", "b"]).get("a") is not None,
                    timeout=20.0)
    assert lookup.degraded is None
    got = lookup.match(prompt, ["a", "b"])
    assert never_wrong(got, chains, prompt) and got["a"].blocks == 40
    r.close()


def test_the_registry_side_stores_and_status_work_on_a_cluster(cluster):
    """Roles, pool targets and `pdserve status` read Redis's clock in their pipelines: on a
    cluster, where a pipeline cannot carry TIME, they ask the index's master for it."""
    from deploy.status import gather
    from kv_index.nodes import Role
    from kv_index.pool_targets import PoolTargets
    from kv_index.roles import RoleStore, start_generation

    r = redis_client(cluster.url, TIMEOUTS)
    ns = f"g-{uuid.uuid4().hex[:6]}"
    start_generation(r, ns)
    fill(r, ns)
    PoolTargets(r, ns).set({Role.PREFILL: 1, Role.DECODE: 1}, "test")
    roles = RoleStore(r, ns)
    roles.request("a", Role.DECODE, "test")
    assert roles.desired("a") is Role.DECODE and set(roles.wishes()) == {"a"}
    assert PoolTargets(r, ns).get() == {Role.PREFILL: 1, Role.DECODE: 1}
    report, _ = gather(r, ns)
    assert report["index"]["entries"] == {"a": 40, "b": 30}
    r.close()


def test_up_takes_a_cluster_flag_and_refuses_it_beside_a_url():
    import argparse

    from deploy.cli import add_up_arguments, cluster_config_from_args

    p = argparse.ArgumentParser()
    add_up_arguments(p)
    assert cluster_config_from_args(p.parse_args(["--redis-cluster", "3"])).redis_cluster == 3
    with pytest.raises(ValueError, match="redis_cluster"):
        cluster_config_from_args(p.parse_args(["--redis-cluster", "3", "--redis-url", "redis+cluster://127.0.0.1:7000"]))


def test_a_killed_master_fails_over_and_lookups_come_back_never_wrong(cluster):
    r = redis_client(cluster.url, TIMEOUTS)
    ns = f"k-{uuid.uuid4().hex[:6]}"
    chains, reader = fill(r, ns)
    lookup = GuardedLookup(reader, LookupBreaker(base_s=0.05, max_s=0.2))
    master = cluster.master_for(nodes_key(ns))
    assert wait_for(lambda: in_sync(cluster, master), timeout=10.0)
    master.kill()  # SIGKILL
    got = lookup.match(chains["a"], ["a", "b"])
    assert got == {} and lookup.degraded is not None  # refused: placed by load

    def answers() -> bool:
        lookup.probe()
        return lookup.match(chains["a"], ["a", "b"]).get("a") is not None

    assert wait_for(answers, timeout=20.0, every=0.1)  # the replica took over
    assert cluster.master_for(nodes_key(ns)) is not master
    for p in (chains["a"], chains["b"], chains["a"][:7] + [1, 2, 3]):
        got = lookup.match(p, ["a", "b"])
        assert never_wrong(got, chains, p), (p[:3], got)
    assert lookup.match(chains["a"], ["a", "b"])["a"].blocks == 40  # replicated before the kill: nothing lost
    # The index takes writes again on the promoted replica.
    pub = NodePublisher(r, NodeInfo("z", "prefill", "127.0.0.1:3", "fp", 16, 1000), ns=ns, lease_s=3600)
    pub.register()
    assert pub.publish(stored=chains["b"][:4])
    assert reader.match(chains["b"], ["z"])["z"].blocks == 4
    try:
        r.close()
    except redis.RedisError:
        pass
