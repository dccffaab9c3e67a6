"""The router's local copy of the index fed by the index's event stream (kv_index/event_feed.py),
against a real redis-server: after real publishers' batches (stores, removals, tier moves, a
clear, a lease that expires, a pruned node) it answers every lookup as the Redis script does and
holds the same entries; a trimmed stream (XTRIM) makes it resync and end equal; the router's
guarded lookup answers from it once it has synced and from Redis before."""
from __future__ import annotations

import time
import uuid

import pytest
import redis

from kv_index.event_feed import EventFeed
from kv_index.nodes import NodeInfo
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from kv_index.schema import TIER_DEVICE, TIER_DISK, TIER_HOST, events_count_key, events_key, node_holdings
from router.index_guard import GuardedLookup
from tokens.block_hash import hash_prompt_blocks


@pytest.fixture()
def r(redis_url):
    c = redis.Redis.from_url(redis_url, socket_timeout=5.0)
    yield c
    c.close()


def node(nid: str) -> NodeInfo:
    return NodeInfo(node_id=nid, role="prefill", grpc_address="127.0.0.1:1", fingerprint="fp", block_size=16,
                    num_blocks=1000)


def chain(seed: int, blocks: int, head: list[int] | None = None) -> list[int]:
    own = hash_prompt_blocks([seed * 1000 + i for i in range(16 * blocks)], 16, b"fp")
    return (head or []) + own[len(head or []):]


def durable(r, ns: str, nid: str) -> dict[int, int]:
    """What Redis holds for a node: hash -> tier mask."""
    return node_holdings(r, ns, nid)[2]


def assert_equal(feed: EventFeed, reader: IndexReader, r, ns: str, prompts, ids) -> None:
    assert feed.caught_up(timeout_s=5.0)
    for p in prompts:
        assert feed.index.match(p, ids) == reader.match(p, ids), p[:2]
    for nid in ids:
        assert feed.index.holdings(nid) == durable(r, ns, nid), nid


def test_the_local_copy_answers_as_redis_after_real_batches(r):
    ns = f"li-{uuid.uuid4().hex[:8]}"
    reader = IndexReader(r, ns)
    pubs = {nid: NodePublisher(r, node(nid), ns=ns, lease_s=0.4 if nid == "c" else 30) for nid in "abc"}
    for p in pubs.values():
        p.register()
    system = chain(0, 4)
    chains = [chain(i, 6 + 3 * i, head=system) for i in range(1, 6)]
    prompts = [c[:k] for c in chains for k in (2, 5, len(c))] + [chain(99, 5)]
    ids = list(pubs)
    feed = EventFeed(r, ns, block_s=0.05)
    lookup = GuardedLookup(IndexReader(r, ns), local=feed)
    assert lookup.match(chains[0], ids) == reader.match(chains[0], ids)  # not synced yet: Redis answers
    lookup.start(timeout_s=5.0)
    try:
        pubs["a"].publish(stored=chains[0] + chains[1])
        pubs["b"].publish(stored={TIER_DEVICE: chains[1][:8], TIER_HOST: chains[1], TIER_DISK: chains[2]})
        pubs["c"].publish(stored=chains[3])
        assert_equal(feed, reader, r, ns, prompts, ids)
        assert lookup.match(chains[1], ids) == reader.match(chains[1], ids)  # the router's path, from memory
        # Removals, a tier move (device -> host), a clear with stores after it.
        pubs["a"].publish(removed=chains[0][6:8])
        pubs["b"].publish(stored={TIER_HOST: chains[1][:8]}, removed={TIER_DEVICE: chains[1][:8]})
        pubs["a"].publish(stored=chains[4], cleared=True)
        assert_equal(feed, reader, r, ns, prompts, ids)
        # c's lease runs out: its next batch is refused (a gap), it resyncs its snapshot.
        time.sleep(0.6)
        assert not pubs["c"].publish(stored=chains[2])
        assert_equal(feed, reader, r, ns, prompts, ids)
        pubs["c"].resync(chains[2][:9])
        assert_equal(feed, reader, r, ns, prompts, ids)
        time.sleep(0.6)  # and again; this time it stays dead and is pruned
        assert reader.prune_dead() == ["c"]
        assert_equal(feed, reader, r, ns, prompts, ids)
        assert feed.index.node_seq("c") is None and feed.gaps == 0 and feed.full_resyncs == 1
        assert lookup.degraded is None
    finally:
        lookup.close()


def test_a_trimmed_stream_makes_the_copy_resync_and_end_equal(r):
    ns = f"li-{uuid.uuid4().hex[:8]}"
    reader = IndexReader(r, ns)
    a, b = NodePublisher(r, node("a"), ns=ns), NodePublisher(r, node("b"), ns=ns)
    a.register()
    b.register()
    chains = [chain(i, 8) for i in range(1, 4)]
    feed = EventFeed(r, ns, block_s=0.05)  # driven step by step: no thread
    feed.full_sync()
    a.publish(stored=chains[0])
    feed.step()
    assert feed.applied == int(r.get(events_count_key(ns)))
    # Behind the stream by three batches, which are trimmed away, then one more arrives.
    a.publish(removed=chains[0][4:])
    b.publish(stored=chains[1])
    a.publish(stored=chains[2])
    r.xtrim(events_key(ns), maxlen=0)
    b.publish(removed=chains[1][:2])
    full = feed.full_resyncs
    feed.step()  # the first event it reads does not follow its last: resync everything
    assert feed.gaps == 1
    feed.step()
    assert feed.full_resyncs == full + 1
    assert_equal(feed, reader, r, ns, chains, ["a", "b"])
    # Trimmed while quiet: nothing to read, but the count moved past the copy.
    a.publish(stored=chains[1][:3])
    r.xtrim(events_key(ns), maxlen=0)
    feed.step()
    assert feed.gaps == 2
    feed.step()
    assert feed.full_resyncs == full + 2
    assert_equal(feed, reader, r, ns, chains, ["a", "b"])
