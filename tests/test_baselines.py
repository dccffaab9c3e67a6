"""The baseline policies' formulas and router-side state on hand-built cases: no sockets."""
from __future__ import annotations

import pytest

from kv_index.nodes import NodeInfo
from router.placement import NoCapacityError, Placement
from router.replay.baselines import (
    DynamoKv,
    LeastLoaded,
    LlmdWeighted,
    LongestPrefix,
    ReplayRequest,
    RoundRobin,
    SglangCacheAware,
)

BS = 16


def req(rid=0, hashes=tuple(range(1, 11)), tokens=160, now=0.0):
    return ReplayRequest(num_prompt_tokens=tokens, block_size=BS, request_id=rid, hashes=tuple(hashes), now=now)


REQ = req()  # 10 blocks


def node(nid, role="prefill", running=0, waiting=0, tokens=0, kv=0.0):
    return NodeInfo(nid, role, f"{nid}:1", "fp", BS, 1000, waiting=waiting, running=running,
                    running_tokens=tokens, kv_usage=kv)


D = [node("d0", "decode", running=3), node("d1", "decode", running=1)]


def pick(policy, prefill, matched, request=REQ):
    return policy.choose(request, prefill + D, matched).prefill_node.node_id


def send(policy, request, nid, cached=0):
    """What the simulator does once a request is admitted: tell the policy where it went."""
    policy.routed(request, Placement(node(nid), D[1], cached, "test"))


def test_every_baseline_uses_the_least_loaded_decode_node():
    for pol in (RoundRobin(), LeastLoaded(), LongestPrefix(), SglangCacheAware(), DynamoKv(), LlmdWeighted()):
        assert pol.choose(REQ, [node("p0")] + D, {}).decode_node.node_id == "d1"
        with pytest.raises(NoCapacityError):
            pol.choose(REQ, [node("p0")], {})


def test_round_robin_cycles_in_id_order():
    rr = RoundRobin()
    ps = [node("p1"), node("p0"), node("p2")]
    assert [pick(rr, ps, {}) for _ in range(4)] == ["p0", "p1", "p2", "p0"]


def test_least_loaded_counts_the_tokens_it_sent_until_they_return():
    ll = LeastLoaded()
    ps = [node("p0"), node("p1"), node("p2")]
    send(ll, req(1, tokens=900), "p0")
    send(ll, req(2, tokens=700), "p2")
    assert pick(ll, ps, {"p0": 10}) == "p1"  # cache ignored
    send(ll, req(3, tokens=800), "p1")
    assert pick(ll, ps, {}) == "p2"  # 900, 800, 700
    ll.finished(1, "p0")
    assert pick(ll, ps, {}) == "p0"


def test_longest_prefix_ignores_load_and_rotates_ties():
    ps = [node("p0", tokens=10**6), node("p1"), node("p2")]
    assert pick(LongestPrefix(), ps, {"p0": 3, "p1": 2}) == "p0"
    lp = LongestPrefix()
    assert [pick(lp, ps, {"p1": 2, "p2": 2}) for _ in range(3)] == ["p1", "p2", "p1"]


def test_sglang_tree_learns_at_routing_time_and_low_matches_go_to_the_smallest_tree():
    pol = SglangCacheAware(cache_threshold=0.3, balance_abs=4, balance_rel=1.5)
    ps = [node("p0"), node("p1"), node("p2")]
    ids = ["p0", "p1", "p2"]
    send(pol, req(1, hashes=range(1, 11)), "p1")  # 10 blocks in p1's tree
    send(pol, req(2, hashes=range(20, 24), tokens=64), "p0")  # 4 blocks in p0's tree
    # The next turn of request 1's conversation matches p1 at once: no KV event needed.
    turn = req(3, hashes=list(range(1, 11)) + [11, 12])
    assert pol.match(turn, ids) == {"p0": 0, "p1": 10, "p2": 0}
    assert pick(pol, ps, pol.match(turn, ids), turn) == "p1"  # rate 10/12 > 0.3
    # match rate 3/10 is not > 0.3 -> the smallest tree: p2 (0 blocks), then p0 (4)
    assert pick(pol, ps, {"p1": 3}) == "p2"
    send(pol, req(4, hashes=range(30, 40)), "p2")
    assert pick(pol, ps, {"p1": 3}) == "p0"


def test_sglang_balance_uses_its_own_in_flight_counts():
    pol = SglangCacheAware(cache_threshold=0.3, balance_abs=4, balance_rel=1.5)
    ps = [node("p0", running=50), node("p1"), node("p2")]  # heartbeats are not what it reads
    for i in range(9):
        send(pol, req(100 + i, hashes=()), "p0")
    send(pol, req(200, hashes=()), "p1")
    send(pol, req(201, hashes=()), "p2")
    send(pol, req(202, hashes=()), "p2")
    # loads 9, 1, 2: 9 - 1 > 4 and 9 > 1.5 -> least loaded whatever the cache says
    assert pick(pol, ps, {"p0": 10}) == "p1"
    for i in range(6):
        pol.finished(100 + i, "p0")
    # loads 3, 1, 2: balanced -> cache wins
    assert pick(pol, ps, {"p0": 10}) == "p0"


def test_sglang_evicts_trees_to_max_size_every_interval():
    pol = SglangCacheAware(max_tree_blocks=4, eviction_interval_s=10.0)
    send(pol, req(1, hashes=range(1, 11), now=0.0), "p0")
    assert pol.tree_blocks("p0") == 10  # over the limit until the next eviction cycle
    send(pol, req(2, hashes=range(50, 52), now=12.0), "p1")
    assert pol.tree_blocks("p0") == 4
    assert pol.match(req(3, hashes=range(1, 11)), ["p0"]) == {"p0": 4}  # the chain's tail went first


def test_dynamo_cost_counts_prefill_tokens_in_flight_and_active_blocks():
    pol = DynamoKv(overlap_weight=1.0)
    ps = [node("p0"), node("p1")]
    # idle: p0: 1.0 * (10 - 8) + 0 active + 10 new blocks = 12 ; p1: 10 + 10 = 20
    assert pol.cost(REQ, "p0", {"p0": 8}) == 12 and pol.cost(REQ, "p1", {"p0": 8}) == 20
    send(pol, req(1, hashes=range(1, 11)), "p0")  # 160 tokens to prefill, 10 active blocks on p0
    other = req(2, hashes=list(range(1, 6)) + list(range(40, 45)))  # shares 5 blocks with request 1
    # p0: (160 + 160) / 16 = 20 + 10 active + 5 new = 35 ; p1: 10 + 0 + 10 = 20
    assert pol.cost(other, "p0", {}) == 35 and pick(pol, ps, {}, other) == "p1"
    # its KV event arrived: p0 holds 5 of them: (160 + 80) / 16 = 15 + 10 + 5 = 30
    assert pol.cost(other, "p0", {"p0": 5}) == 30
    pol.finished(1, "p0")
    # prefill done and released: p0: 5 + 0 + 10 = 15 < 20
    assert pol.cost(other, "p0", {"p0": 5}) == 15 and pick(pol, ps, {"p0": 5}, other) == "p0"
    # overlap weight 0.5 halves only the prefill term
    assert DynamoKv(0.5).cost(REQ, "p1", {}) == 5 + 10


def test_dynamo_counts_unhashed_prompts_as_unshared_blocks():
    pol = DynamoKv()
    send(pol, req(1, hashes=()), "p0")
    assert pol.active_blocks("p0") == 10
    assert pol.cost(req(2, hashes=()), "p0", {}) == (160 + 160) / 16 + 10 + 10
    pol.finished(1, "p0")
    assert pol.active_blocks("p0") == 0


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


def test_llmd_prefix_lru_is_filled_at_routing_time_and_bounded():
    pol = LlmdWeighted(lru_blocks=6)
    send(pol, req(1, hashes=range(1, 11)), "p1")
    assert pol.match(req(2, hashes=range(1, 11)), ["p0", "p1"]) == {"p0": 0, "p1": 6}  # LRU kept the chain's head


# -- tiers: the peers' published weights -------------------------------------------------------------
def test_dynamo_credits_host_and_disk_hits_at_its_published_weights():
    from kv_index.nodes import PrefixMatch

    pol = DynamoKv(overlap_weight=1.0)  # host 0.75, disk 0.25: Dynamo's defaults
    assert (pol.host_weight, pol.disk_weight) == (0.75, 0.25)
    # 8 leading blocks: 2 on the device, 4 in host memory, 2 on disk -> 2 + 3 + 0.5 = 5.5 credited
    tiered = {"p0": PrefixMatch(8, host=4, disk=2)}
    assert pol.overlap(REQ, "p0", tiered) == 5.5
    # (160 - 88) / 16 = 4.5 prefill blocks + 0 active + 10 new
    assert pol.cost(REQ, "p0", tiered) == 14.5
    assert pol.cost(REQ, "p0", {"p0": PrefixMatch(8)}) == pol.cost(REQ, "p0", {"p0": 8}) == 12
    # what it books for the prefill is the prompt less the credited overlap
    r = req(5)
    pl = pol.choose(r, [node("p0"), node("p1")] + D, tiered)
    assert pl.prefill_node.node_id == "p0" and pl.predicted_cached_tokens == 128  # the node reuses all 8
    pol.routed(r, pl)
    assert pol.cost(req(6, hashes=range(50, 60)), "p0", {}) == (72 + 160) / 16 + 10 + 10


def test_llmd_precise_scorer_weighs_each_block_by_its_tier():
    from kv_index.nodes import PrefixMatch
    from router.replay.baselines import LLMD_TIER_WEIGHTS

    approx = LlmdWeighted(lru_blocks=100)
    assert not approx.uses_index and approx.match(REQ, ["p0"]) == {"p0": 0}
    pol = LlmdWeighted(tier_weights=LLMD_TIER_WEIGHTS)  # gpu 1.0, cpu 0.8, storage 0.3
    assert pol.uses_index and pol.match(REQ, ["p0"]) is None  # reads the KV-event index
    matched = {"p0": PrefixMatch(10), "p1": PrefixMatch(10, host=10), "p2": PrefixMatch(10, disk=10)}
    # raw 10, 8, 3 -> min-max over the pods that hold any; a pod holding none scores 0
    scores = pol.prefix_scores(REQ, ["p0", "p1", "p2", "p3"], matched)
    assert scores == pytest.approx({"p0": 1.0, "p1": 5 / 7, "p2": 0.0, "p3": 0.0})
    assert pol.prefix_scores(REQ, ["p0", "p1"], {"p0": PrefixMatch(4), "p1": PrefixMatch(4)}) == {"p0": 1.0,
                                                                                                   "p1": 1.0}
    assert pol.prefix_scores(REQ, ["p0", "p1"], {}) == {"p0": 0.0, "p1": 0.0}
    assert pick(pol, [node("p0"), node("p1"), node("p2")], matched) == "p0"
    send(pol, REQ, "p2")  # the precise scorer keeps no tree of its own
    assert pol._lru == {}


def test_with_tiers_sglang_trees_span_the_hierarchy_and_llmd_turns_precise():
    from router.replay.simulator import SimConfig

    mod = pytest.importorskip("bench").benchmark_module("router")
    flat = SimConfig(cache_tokens=5120, block_size=512)
    tiered = SimConfig(cache_tokens=5120, host_cache_tokens=10240, disk_cache_tokens=20480, block_size=512)
    assert mod.make_policy("sglang_cache_aware", flat, None).max_tree_blocks == 10
    assert mod.make_policy("sglang_cache_aware", tiered, None).max_tree_blocks == 70
    assert mod.make_policy("llmd_weighted", flat, None).tier_weights is None
    assert mod.make_policy("llmd_weighted", tiered, None).tier_weights == {0: 1.0, 1: 0.8, 2: 0.3}
    assert mod.make_policy("pdserve", tiered, None).replicate and not mod.make_policy("pdserve_no_fetch", flat,
                                                                                         None).replicate
