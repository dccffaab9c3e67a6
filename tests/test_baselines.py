"""The baseline policies' formulas on hand-built cases: no sockets."""
from __future__ import annotations

import pytest

from kv_index.nodes import NodeInfo
from router.placement import NoCapacityError, PlacementRequest
from router.replay.baselines import DynamoKv, LeastLoaded, LlmdWeighted, LongestPrefix, RoundRobin, SglangCacheAware

BS = 16
REQ = PlacementRequest(num_prompt_tokens=160, block_size=BS)  # 10 blocks


def node(nid, role="prefill", running=0, waiting=0, tokens=0, kv=0.0):
    return NodeInfo(nid, role, f"{nid}:1", "fp", BS, 1000, waiting=waiting, running=running,
                    running_tokens=tokens, kv_usage=kv)


D = [node("d0", "decode", running=3), node("d1", "decode", running=1)]


def pick(policy, prefill, matched, req=REQ):
    return policy.choose(req, prefill + D, matched).prefill_node.node_id


def test_every_baseline_uses_the_least_loaded_decode_node():
    for pol in (RoundRobin(), LeastLoaded(), LongestPrefix(), SglangCacheAware(), DynamoKv(), LlmdWeighted()):
        assert pol.choose(REQ, [node("p0")] + D, {}).decode_node.node_id == "d1"
        with pytest.raises(NoCapacityError):
            pol.choose(REQ, [node("p0")], {})


def test_round_robin_cycles_in_id_order():
    rr = RoundRobin()
    ps = [node("p1"), node("p0"), node("p2")]
    assert [pick(rr, ps, {}) for _ in range(4)] == ["p0", "p1", "p2", "p0"]


def test_least_loaded_counts_outstanding_tokens():
    ps = [node("p0", tokens=900), node("p1", tokens=100, waiting=1), node("p2", tokens=700)]
    # p1: 100 + 1 waiting x 512 nominal = 612 < 700
    assert pick(LeastLoaded(), ps, {"p0": 10}) == "p1"


def test_longest_prefix_ignores_load_and_rotates_ties():
    ps = [node("p0", tokens=10**6), node("p1"), node("p2")]
    assert pick(LongestPrefix(), ps, {"p0": 3, "p1": 2}) == "p0"
    lp = LongestPrefix()
    assert [pick(lp, ps, {"p1": 2, "p2": 2}) for _ in range(3)] == ["p1", "p2", "p1"]


def test_sglang_cache_threshold_and_balance_thresholds():
    pol = SglangCacheAware(cache_threshold=0.3, balance_abs=4, balance_rel=1.5)
    ps = [node("p0", running=2, kv=0.5), node("p1", running=1, kv=0.9), node("p2", running=1, kv=0.2)]
    # match rate 4/10 > 0.3 -> the best-matching node
    assert pick(pol, ps, {"p1": 4}) == "p1"
    # match rate 3/10 is not > 0.3 -> the emptiest cache (smallest tree)
    assert pick(pol, ps, {"p1": 3}) == "p2"
    # imbalanced: 9 - 1 > 4 and 9 > 1.5 x 1 -> least loaded whatever the cache says
    ps = [node("p0", running=9), node("p1", running=1, kv=0.9), node("p2", running=3)]
    assert pick(pol, ps, {"p0": 10}) == "p1"
    # large gap but not relatively large (11 <= 1.5 x 8): not imbalanced, cache wins
    ps = [node("p0", running=11), node("p1", running=8)]
    assert pick(pol, ps, {"p0": 10}) == "p0"


def test_dynamo_cost_is_overlap_weighted_prefill_blocks_plus_active_blocks():
    ps = [node("p0", tokens=6 * BS), node("p1", tokens=0)]
    # p0: 1.0 * (10 - 8) + 6 = 8 ; p1: 10 + 0 = 10 -> p0
    assert pick(DynamoKv(1.0), ps, {"p0": 8}) == "p0"
    # overlap weight 0.5: p0: 1 + 6 = 7 ; p1: 5 -> p1
    assert pick(DynamoKv(0.5), ps, {"p0": 8}) == "p1"


def test_llmd_weighted_scorers():
    pol = LlmdWeighted(prefix_weight=3, kv_weight=2, queue_weight=2)
    ps = [node("p0", waiting=4, kv=0.5), node("p1", waiting=0, kv=0.5), node("p2", waiting=2, kv=0.0)]
    # p0: 3*0.5 + 2*0.5 + 2*0 = 2.5 ; p1: 0 + 1 + 2 = 3 ; p2: 0 + 2 + 1 = 3 -> tie between p1 and p2: p1 is less loaded
    assert pick(pol, ps, {"p0": 5}) == "p1"
    # a full prefix match outweighs the queue: p0: 3 + 1 + 0 = 4
    assert pick(pol, ps, {"p0": 10}) == "p0"
    # equal queues: the queue scorer gives everyone 1
    ps = [node("p0", waiting=1, kv=0.9), node("p1", waiting=1, kv=0.1)]
    assert pick(pol, ps, {}) == "p1"
