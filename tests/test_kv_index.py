"""The Redis KV-block index and node registry against a real redis-server on loopback."""
from __future__ import annotations

import time

import pytest
import redis

from kv_index.nodes import NodeInfo, PrefixMatch
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from kv_index.schema import event_keys, node_holdings, node_key
from tokens.block_hash import hash_prompt_blocks


@pytest.fixture()
def r(redis_url):
    c = redis.Redis.from_url(redis_url)
    c.flushall()
    yield c
    c.close()


def blocks(matched):
    """A match's leading blocks per node, whatever their tiers."""
    return {nid: m.blocks for nid, m in matched.items()}


def node(nid, role="prefill", port=1):
    return NodeInfo(node_id=nid, role=role, grpc_address=f"127.0.0.1:{port}", fingerprint="fp",
                    block_size=16, num_blocks=100)


def test_register_heartbeat_and_longest_prefix_match(r):
    a, b = NodePublisher(r, node("a")), NodePublisher(r, node("b", port=2))
    a.register()
    b.register()
    hashes = hash_prompt_blocks(list(range(64)), 16, b"fp")
    a.publish(stored=hashes[:3])
    b.publish(stored=hashes[:1])
    a.heartbeat({"waiting": 2, "running": 5, "free_blocks": 40, "kv_usage": 0.6, "step_s": 0.3,
                 "decode_step_s": 0.1, "decode_step_running": 3.5, "decode_step_tokens": 812.5})
    reader = IndexReader(r)
    nodes = reader.live_nodes()
    assert set(nodes) == {"a", "b"}
    assert nodes["a"].running == 5 and nodes["a"].kv_usage == pytest.approx(0.6)
    assert (nodes["a"].step_s, nodes["a"].decode_step_s) == (0.3, 0.1)
    assert (nodes["a"].decode_step_running, nodes["a"].decode_step_tokens) == (3.5, 812.5)
    assert nodes["b"].decode_step_s == 0.0  # never said: unknown
    before = reader.round_trips
    assert blocks(reader.match(hashes, ["a", "b"])) == {"a": 3, "b": 1}
    assert reader.round_trips == before + 1
    # A gap in the chain ends the match even if later blocks are held.
    a.publish(removed=[hashes[1]])
    assert blocks(reader.match(hashes, ["a"])) == {"a": 1}


def test_the_matmul_curve_travels_with_the_registration(r):
    from dataclasses import replace
    curve = ((1, 40.6), (3, 43.4), (4, 63.6), (16, 83.25))
    p = NodePublisher(r, replace(node("c"), matmul_ms=curve))
    p.register()
    p.heartbeat({"running": 1})
    assert IndexReader(r).live_nodes()["c"].matmul_ms == curve
    r.hset(node_key("pdserve", "c"), "matmul_ms", "1:40,x:3")  # unreadable: unknown, the node still listed
    assert IndexReader(r).live_nodes()["c"].matmul_ms == ()


def test_lease_expiry_hides_a_dead_node_and_prune_removes_its_entries(r):
    p = NodePublisher(r, node("dead"), lease_s=0.3)
    p.register()
    h = hash_prompt_blocks(list(range(32)), 16, b"fp")
    p.publish(stored=h)
    reader = IndexReader(r)
    assert "dead" in reader.live_nodes()
    time.sleep(0.5)
    assert "dead" not in reader.live_nodes()
    assert reader.prune_dead() == ["dead"]
    assert blocks(reader.match(h, ["dead"])) == {"dead": 0}
    assert not r.keys("{pdserve}:b:*")


def test_reregistration_drops_what_a_restarted_node_published(r):
    p = NodePublisher(r, node("n"))
    p.register()
    h = hash_prompt_blocks(list(range(32)), 16, b"fp")
    p.publish(stored=h)
    p.register()  # a restart: the new pool holds nothing
    assert blocks(IndexReader(r).match(h, ["n"])) == {"n": 0}
    p.publish(stored=h)
    p.publish(cleared=True)
    assert blocks(IndexReader(r).match(h, ["n"])) == {"n": 0}
    p.deregister()
    # Nothing of the node is left; the index's event stream (routers' local copies) stays.
    assert set(r.keys("{pdserve}:*")) <= {k.encode() for k in event_keys("pdserve")}


# ----------------------------------------------------------------------------- at scale
import threading  # noqa: E402

from kv_index.events import BlockRemoved, BlockStored  # noqa: E402
from kv_index.nodes import StepReport, index_freshness
from kv_index.schema import TIER_HOST
from node.publisher import IndexPublisherThread  # noqa: E402


def test_a_4k_token_prompt_is_one_round_trip_and_tiers_are_reported(r):
    a = NodePublisher(r, node("a"))
    b = NodePublisher(r, node("b", port=2), tier=TIER_HOST)
    a.register()
    b.register()
    hashes = hash_prompt_blocks(list(range(4096)), 16, b"fp")  # 256 blocks
    assert a.publish(stored=hashes[:200])
    assert b.publish(stored=hashes)
    reader = IndexReader(r)
    reader.match(hashes[:1], ["a"])  # the first call per Redis lifetime also loads the script
    before = reader.round_trips
    r.config_resetstat()
    assert reader.match(hashes, ["a", "b", "c"]) == {"a": PrefixMatch(200), "b": PrefixMatch(256, host=256),
                                                      "c": PrefixMatch(0)}
    assert reader.round_trips == before + 1
    # exactly one client command reached the server: the script call
    stats = r.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 1
    assert "cmdstat_script" not in stats and "cmdstat_smembers" not in stats


def test_concurrent_publishers_leave_each_node_exactly_its_blocks(r):
    ids = [f"n{i}" for i in range(4)]
    chains = {nid: hash_prompt_blocks([i] * 16 * 60, 16, b"fp") for i, nid in enumerate(ids)}
    shared = hash_prompt_blocks([999] * 16 * 20, 16, b"fp")  # every node stores these too

    def worker(nid):
        client = redis.Redis(connection_pool=r.connection_pool)  # thread-safe pool, own connections
        pub = NodePublisher(client, node(nid))
        pub.register()
        mine = chains[nid]
        for i in range(0, 60, 5):  # interleaved stores and evictions in many small batches
            assert pub.publish(stored=mine[i:i + 5] + shared[i // 3:i // 3 + 2])
            if i >= 10:
                assert pub.publish(removed=mine[i - 10:i - 8])

    threads = [threading.Thread(target=worker, args=(nid,)) for nid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reader = IndexReader(r)
    for nid in ids:
        held = set(chains[nid]) - {h for i in range(10, 60, 5) for h in chains[nid][i - 10:i - 8]}
        held |= set(shared[:20])
        assert set(node_holdings(r, "pdserve", nid)[2]) == held
    assert blocks(reader.match(shared, ids)) == {nid: 20 for nid in ids}


def test_event_gap_is_refused_and_resync_restores_the_snapshot(r):
    p = NodePublisher(r, node("g"))
    p.register()
    h = hash_prompt_blocks(list(range(160)), 16, b"fp")
    assert p.publish(stored=h[:4])
    p.seq += 1  # a batch got lost on the way: the next one does not follow the last applied
    assert not p.publish(stored=h[4:6])
    reader = IndexReader(r)
    assert blocks(reader.match(h, ["g"])) == {"g": 4}  # the refused batch changed nothing
    p.resync(held=h[:8])
    assert blocks(reader.match(h, ["g"])) == {"g": 8}
    assert p.publish(removed=[h[7]])  # sequence continues after the resync
    assert blocks(reader.match(h, ["g"])) == {"g": 7}
    # Redis lost everything (restart): the node's next batch is a gap, its heartbeat says so
    r.flushall()
    assert not p.publish(stored=h[8:9])
    assert p.heartbeat({"waiting": 0}) is False
    p.resync(held=h[:3])
    assert blocks(reader.match(h, ["g"])) == {"g": 3} and "g" in reader.live_nodes()


def test_publisher_thread_resyncs_from_its_snapshot_after_redis_loses_the_index(r):
    pub = NodePublisher(r, node("t"), lease_s=5.0)
    thread = IndexPublisherThread(pub, lambda: {"waiting": 0}, heartbeat_s=0.05)
    thread.start()
    h = hash_prompt_blocks(list(range(160)), 16, b"fp")
    thread.submit_events([BlockStored(tuple(h[:6]), None, ())])
    thread.submit_events([BlockRemoved(tuple(h[5:6]))])
    reader = IndexReader(r)
    _eventually(lambda: blocks(reader.match(h, ["t"])) == {"t": 5})
    r.flushall()  # a Redis restart
    _eventually(lambda: blocks(reader.match(h, ["t"])) == {"t": 5} and "t" in reader.live_nodes())
    assert thread.num_resyncs >= 1
    thread.submit_step(StepReport(100, 300, 0.05))
    _eventually(lambda: reader.read_steps({"t": "0-0"})["t"][0] == [StepReport(100, 300, 0.05)])
    thread.stop()
    assert "t" not in reader.live_nodes() and blocks(reader.match(h, ["t"])) == {"t": 0}


def test_two_router_replicas_see_the_same_index_and_freshness(r):
    p = NodePublisher(r, node("f"))
    p.register()
    h = hash_prompt_blocks(list(range(64)), 16, b"fp")
    t0 = time.time()
    p.publish(stored=h)
    one, two = IndexReader(r), IndexReader(redis.Redis(connection_pool=r.connection_pool))
    assert blocks(one.match(h, ["f"])) == blocks(two.match(h, ["f"])) == {"f": 4}
    info = one.live_nodes()["f"]
    assert info.index_seq == 1 and info.event_at >= t0 - 1
    age = index_freshness([info], time.time() + 2.0)["f"]
    assert 2.0 <= age < 4.0


def _eventually(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    assert cond()


# ----------------------------------------------------------------------------- tiers
def test_a_block_in_several_tiers_is_added_and_removed_per_tier(r):
    """A node may hold a block in device, host and disk at once; each tier comes and goes on its
    own, and a lookup counts each block once, in the fastest tier the node holds it in."""
    from kv_index.schema import TIER_DEVICE, TIER_DISK

    p = NodePublisher(r, node("t"))
    p.register()
    h = hash_prompt_blocks(list(range(96)), 16, b"fp")  # 6 blocks
    reader = IndexReader(r)
    assert p.publish(stored={TIER_DEVICE: h[:2], TIER_HOST: h[:4], TIER_DISK: h})
    assert reader.match(h, ["t"]) == {"t": PrefixMatch(6, host=2, disk=2)}
    # The device copies go (evicted; the host tier kept its copies): host is now the fastest.
    assert p.publish(removed={TIER_DEVICE: h[:2]})
    assert reader.match(h, ["t"]) == {"t": PrefixMatch(6, host=4, disk=2)}
    # Removing a tier a block is not in changes nothing; removing its last tier removes the entry.
    assert p.publish(removed={TIER_DEVICE: h[4:5], TIER_HOST: h[3:4], TIER_DISK: h[3:4]})
    assert reader.match(h, ["t"]) == {"t": PrefixMatch(3, host=3)}
    held = node_holdings(r, "pdserve", "t")[2]
    assert h[3] not in held and set(held) == set(h) - {h[3]}
    # A batch stores and removes in one round trip: removals first, then stores.
    assert p.publish(stored={TIER_DEVICE: h[3:4]}, removed={TIER_HOST: h[3:4]})
    assert reader.match(h, ["t"]) == {"t": PrefixMatch(6, host=3, disk=2)}
    assert p.publish(cleared=True)
    assert reader.match(h, ["t"]) == {"t": PrefixMatch(0)} and not node_holdings(r, "pdserve", "t")[2]


def test_resync_restores_every_tier_of_the_snapshot(r):
    from kv_index.schema import TIER_DISK, tier_bit

    p = NodePublisher(r, node("s"))
    p.register()
    h = hash_prompt_blocks(list(range(80)), 16, b"fp")  # 5 blocks
    assert p.publish(stored={TIER_HOST: h})
    dev, host, disk = tier_bit(0), tier_bit(TIER_HOST), tier_bit(TIER_DISK)
    p.resync({h[0]: dev | host, h[1]: host, h[2]: disk | host, h[3]: disk, h[4]: 0})
    reader = IndexReader(r)
    assert reader.match(h, ["s"]) == {"s": PrefixMatch(4, host=2, disk=1)}
    held = node_holdings(r, "pdserve", "s")[2]
    assert set(held) == set(h[:4]) and held[h[2]] == disk | host


def test_publisher_thread_folds_tier_moves_and_resyncs_them(r):
    """Offload (device -> host) and onboard events through the node's thread; a Redis that lost
    everything gets every tier back from the thread's snapshot."""
    from kv_index.schema import TIER_DISK

    pub = NodePublisher(r, node("m"), lease_s=5.0)
    thread = IndexPublisherThread(pub, lambda: {"waiting": 0}, heartbeat_s=0.05)
    thread.start()
    h = hash_prompt_blocks(list(range(64)), 16, b"fp")
    thread.submit_events([BlockStored(tuple(h), None, ())])
    thread.submit_events([BlockStored(tuple(h[2:]), None, (), tier=TIER_HOST), BlockRemoved(tuple(h[2:]))])
    thread.submit_events([BlockStored(tuple(h[3:]), None, (), tier=TIER_DISK),
                          BlockRemoved(tuple(h[3:]), tier=TIER_HOST)])
    reader = IndexReader(r)
    want = {"m": PrefixMatch(4, host=1, disk=1)}
    _eventually(lambda: reader.match(h, ["m"]) == want)
    r.flushall()
    _eventually(lambda: reader.match(h, ["m"]) == want and "m" in reader.live_nodes())
    thread.stop()


def test_onboard_totals_reach_the_routers_cost_book(r):
    """A node heartbeats what it brought back from its host and disk tiers (cumulative); the
    router's node view feeds each refresh's difference into the cost book's (node, tier) fits,
    and a node that restarted (totals down) counts from zero again."""
    from kv_index.nodes import OnboardTotals
    from router.cost_model import CostBook
    from router.node_view import NodeRefresher

    assert OnboardTotals.parse("") == OnboardTotals() and OnboardTotals.parse("x,1") == OnboardTotals()
    t = OnboardTotals(8 << 20, 0.01, 4)
    assert OnboardTotals.parse(t.wire()) == t
    assert OnboardTotals(12 << 20, 0.02, 6).since(t) == OnboardTotals(4 << 20, 0.01, 2)
    assert OnboardTotals(1 << 20, 0.001, 1).since(t) == OnboardTotals(1 << 20, 0.001, 1)  # a restart

    p = NodePublisher(r, node("o"))
    p.register()
    costs = CostBook()
    refresher = NodeRefresher(IndexReader(r), refresh_s=0.1, prune_every_s=60, costs=costs)
    for host in (OnboardTotals(8 << 20, 0.01, 4), OnboardTotals(16 << 20, 0.02, 8)):
        p.heartbeat({"waiting": 0, "onboard_host": host.wire(), "onboard_disk": OnboardTotals(1 << 20, 0.05, 1).wire()})
        refresher.refresh_once()
    fits = {(f.node_id, f.tier): f for f in costs.onboard_fits()}
    assert fits["o", "host"].onboards == 2 and fits["o", "disk"].onboards == 1  # the disk total did not move
    assert refresher.view.nodes[0].onboard_host == OnboardTotals(16 << 20, 0.02, 8)


def test_the_256th_node_is_refused_by_name_and_a_freed_slot_inherits_nothing(r):
    from kv_index.publisher import IndexFull
    from kv_index.schema import MAX_SLOTS, slots_key

    h = hash_prompt_blocks(list(range(64)), 16, b"fp")
    pubs = [NodePublisher(r, node(f"n{i}"), lease_s=60) for i in range(MAX_SLOTS)]
    for p in pubs:
        p.register()
    assert pubs[7].publish(stored=h)
    late = NodePublisher(r, node("late"), lease_s=60)
    with pytest.raises(IndexFull, match=r"late.*255"):
        late.register()
    assert r.hlen(slots_key("pdserve")) == MAX_SLOTS
    slot = int(r.hget(slots_key("pdserve"), "n7"))
    pubs[7].deregister()
    late.register()  # n7's slot, none of n7's entries
    assert int(r.hget(slots_key("pdserve"), "late")) == slot
    assert blocks(IndexReader(r).match(h, ["late", "n7"])) == {"late": 0, "n7": 0}
    assert late.publish(stored=h[:2])
    assert blocks(IndexReader(r).match(h, ["late"])) == {"late": 2}
