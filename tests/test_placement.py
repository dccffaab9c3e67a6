"""PrefixLoadPolicy on hand-built node lists: no sockets, no Redis."""
from __future__ import annotations

import pytest

from kv_index.nodes import NodeInfo
from router.placement import NoCapacityError, PlacementRequest, PrefixLoadPolicy


def node(node_id, role="prefill", running=0, waiting=0, running_tokens=0, kv_usage=0.0):
    return NodeInfo(node_id=node_id, role=role, grpc_address=f"{node_id}:1", fingerprint="fp",
                    block_size=16, num_blocks=100, waiting=waiting, running=running,
                    running_tokens=running_tokens, kv_usage=kv_usage)


REQ = PlacementRequest(num_prompt_tokens=256, block_size=16)
POLICY = PrefixLoadPolicy(alpha=0.5, short_prompt_tokens=64)


def test_repeated_prefix_goes_to_the_node_holding_it():
    nodes = [node("p0"), node("p1"), node("p2"), node("d0", "decode")]
    p = POLICY.choose(REQ, nodes, {"p1": 10})
    assert p.prefill_node.node_id == "p1"
    assert p.predicted_cached_tokens == 160
    assert p.decode_node.node_id == "d0"


def test_load_breaks_ties():
    nodes = [node("p0", running_tokens=300), node("p1", running_tokens=100), node("p2", running_tokens=200),
             node("d0", "decode")]
    # no cache anywhere: the least loaded wins
    assert POLICY.choose(REQ, nodes, {}).prefill_node.node_id == "p1"
    # equal score (cache offsets load exactly): the smaller backlog wins
    nodes = [node("p0", running_tokens=320), node("p1"), node("d0", "decode")]
    assert POLICY.choose(REQ, nodes, {"p0": 10}).prefill_node.node_id == "p1"


def test_equal_nodes_tie_break_is_deterministic():
    nodes = [node("p1"), node("p0"), node("d0", "decode")]
    assert POLICY.choose(REQ, nodes, {}).prefill_node.node_id == "p0"


def test_heavy_load_outweighs_a_cache_hit():
    # p0 holds 160 cached tokens but has 1000 queued: 160 - 0.5*1000 < 0 - 0.5*0
    nodes = [node("p0", running_tokens=1000), node("p1"), node("d0", "decode")]
    assert POLICY.choose(REQ, nodes, {"p0": 10}).prefill_node.node_id == "p1"
    # a light load does not: 160 - 0.5*100 > 0
    nodes = [node("p0", running_tokens=100), node("p1"), node("d0", "decode")]
    assert POLICY.choose(REQ, nodes, {"p0": 10}).prefill_node.node_id == "p0"
    # waiting requests count as backlog too
    nodes = [node("p0", waiting=4), node("p1"), node("d0", "decode")]
    assert POLICY.choose(REQ, nodes, {"p0": 10}).prefill_node.node_id == "p1"


def test_no_prefill_nodes_means_local_prefill():
    nodes = [node("d0", "decode"), node("d1", "decode")]
    p = POLICY.choose(REQ, nodes, {"d1": 4})
    assert p.prefill_node is None
    assert p.decode_node.node_id == "d0"
    assert "no live prefill" in p.reason


def test_short_prompt_and_n_prefill_on_decode():
    nodes = [node("p0"), node("d0", "decode")]
    short = PlacementRequest(num_prompt_tokens=63, block_size=16)
    assert POLICY.choose(short, nodes, {}).prefill_node is None
    at_limit = PlacementRequest(num_prompt_tokens=64, block_size=16)
    assert POLICY.choose(at_limit, nodes, {}).prefill_node.node_id == "p0"
    many = PlacementRequest(num_prompt_tokens=256, block_size=16, n=2)
    assert POLICY.choose(many, nodes, {}).prefill_node is None


def test_decode_node_is_least_loaded():
    nodes = [node("p0"), node("d0", "decode", running=5), node("d1", "decode", running=2, kv_usage=0.9),
             node("d2", "decode", running=2, kv_usage=0.1)]
    assert POLICY.choose(REQ, nodes, {}).decode_node.node_id == "d2"


def test_no_decode_node_raises():
    with pytest.raises(NoCapacityError):
        POLICY.choose(REQ, [node("p0")], {})


def test_cached_tokens_capped_at_prompt_length():
    req = PlacementRequest(num_prompt_tokens=100, block_size=16)
    p = POLICY.choose(req, [node("p0"), node("d0", "decode")], {"p0": 7})
    assert p.predicted_cached_tokens == 100


def test_a_decode_node_with_slow_steps_is_routed_around():
    """Issue 12 `slow-node`: decode-0's steps take 10x its peer's. Its load looks better (it is
    the lower id, and less busy), yet both policies place on decode-1; a node reporting no step
    time (idle, or its figure gone stale) stays a candidate, and so does the lone node."""
    from dataclasses import replace

    from router.cost_model import CostBook
    from router.placement import TtftPolicy, without_stragglers

    slow = replace(node("decode-0", "decode"), step_s=0.30)
    fast = replace(node("decode-1", "decode", running=3, running_tokens=600), step_s=0.03)
    nodes = [node("prefill-0"), slow, fast]
    for policy in (POLICY, TtftPolicy(CostBook(), short_prompt_tokens=64)):
        assert policy.choose(REQ, nodes, {}).decode_node.node_id == "decode-1"
        short = PlacementRequest(num_prompt_tokens=8, block_size=16)  # prefilled on the decode node
        assert policy.choose(short, nodes, {}).decode_node.node_id == "decode-1"
        # the same slow node without a measured step time, or without a faster peer, is used
        assert policy.choose(REQ, [replace(slow, step_s=0.0), fast], {}).decode_node.node_id == "decode-0"
        assert policy.choose(REQ, [slow], {}).decode_node.node_id == "decode-0"
    assert without_stragglers([slow, fast], factor=20.0) == [slow, fast]  # within the factor
    assert without_stragglers([slow, fast], factor=0) == [slow, fast]  # 0 turns it off
