"""The Redis KV-block index and node registry against a real redis-server on loopback."""
from __future__ import annotations

import time

import pytest
import redis

from engine.block_hash import hash_prompt_blocks
from kv_transfer.kv_index import IndexReader, NodeInfo, NodePublisher


@pytest.fixture()
def r(redis_url):
    c = redis.Redis.from_url(redis_url)
    c.flushall()
    yield c
    c.close()


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
    a.heartbeat({"waiting": 2, "running": 5, "free_blocks": 40, "kv_usage": 0.6})
    reader = IndexReader(r)
    nodes = reader.live_nodes()
    assert set(nodes) == {"a", "b"}
    assert nodes["a"].running == 5 and nodes["a"].kv_usage == pytest.approx(0.6)
    before = reader.round_trips
    assert reader.match(hashes, ["a", "b"]) == {"a": 3, "b": 1}
    assert reader.round_trips == before + 1
    # A gap in the chain ends the match even if later blocks are held.
    a.publish(removed=[hashes[1]])
    assert reader.match(hashes, ["a"]) == {"a": 1}


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
    assert reader.match(h, ["dead"]) == {"dead": 0}
    assert not r.keys("pdserve:blk:*")


def test_reregistration_drops_what_a_restarted_node_published(r):
    p = NodePublisher(r, node("n"))
    p.register()
    h = hash_prompt_blocks(list(range(32)), 16, b"fp")
    p.publish(stored=h)
    p.register()  # a restart: the new pool holds nothing
    assert IndexReader(r).match(h, ["n"]) == {"n": 0}
    p.publish(stored=h)
    p.publish(cleared=True)
    assert IndexReader(r).match(h, ["n"]) == {"n": 0}
    p.deregister()
    assert not r.keys("pdserve:*")
