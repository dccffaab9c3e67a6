"""Tier-aware placement on hand-built costs: a prefix held on the device, in host memory, on
disk or on another node (PrefixMatch inputs), and what each costs the chosen prefill node. No
sockets: plain NodeInfo, a CostBook with chosen priors."""
from __future__ import annotations

import pytest

from kv_index.nodes import NodeInfo, PrefixMatch, StepReport
from router.cost_model import CostBook, PrefillCost, TransferCost
from router.placement import PlacementRequest, TtftPolicy, holder_reads, tier_tokens

BS = 100
KVB = 1000  # KV bytes per token
REQ = PlacementRequest(num_prompt_tokens=1000, block_size=BS, slo_class="batch")  # 10 blocks


def book(host_bw=1e9, disk_bw=1e9, net_bw=25e9) -> CostBook:
    """1 ms per computed token; onboards and transfers at the given bandwidths, no fixed cost."""
    return CostBook(prior=PrefillCost(0.0, 1e-3, 0.0), kv_bytes_per_token=KVB, default_bandwidth=net_bw,
                    onboard_priors={"host": TransferCost(0.0, host_bw), "disk": TransferCost(0.0, disk_bw)})


def nodes(*ids: str) -> list[NodeInfo]:
    return [NodeInfo(n, "prefill", f"{n}:1", "fp", BS, 1000) for n in ids] + [
        NodeInfo("d0", "decode", "d0:1", "fp", BS, 1000)]


def choose(policy, matched, backlog=None, ids=("p0", "p1", "p2", "p3")):
    backlog = {"d0": 0.0, **{n: 0.0 for n in ids}, **(backlog or {})}
    return policy.choose(REQ, nodes(*ids), matched, backlog)


def test_tier_tokens_and_what_a_holder_reads_before_sending():
    m = PrefixMatch(8, host=3, disk=2)  # device blocks 0-2, host 3-5, disk 6-7
    assert m.device == 3 and tier_tokens(REQ, m) == (300, 300, 200)
    assert tier_tokens(PlacementRequest(650, BS), m) == (300, 300, 50)  # capped at the prompt
    assert holder_reads(REQ, m, 0) == (300, 200)
    assert holder_reads(REQ, m, 400) == (200, 200)  # the receiver has blocks 0-3
    assert holder_reads(REQ, m, 700) == (0, 100)


def test_a_device_hit_is_free_a_host_hit_costs_its_onboard():
    pol = TtftPolicy(book(host_bw=1e8, disk_bw=1e7), short_prompt_tokens=0, compute_weight=0.0)
    matched = {"p0": PrefixMatch(8), "p1": PrefixMatch(8, host=8), "p2": PrefixMatch(8, disk=8)}
    pl = choose(pol, matched)
    assert pl.prefill_node.node_id == "p0" and pl.predicted_cached_tokens == 800
    assert pl.estimate.prefill_s == pytest.approx(0.2)  # 200 tokens computed, nothing to load
    # p0 queued 0.1 s: p1's host hits load in 800 * 1000 B / 100 MB/s = 8 ms, during its (empty) queue
    pl = choose(pol, matched, {"p0": 0.1})
    assert pl.prefill_node.node_id == "p1" and pl.predicted_cached_tokens == 800
    assert pl.estimate.load_s == pytest.approx(0.008)
    assert pl.estimate.prefill_s == pytest.approx(0.208) and pl.estimate.compute_s == pytest.approx(0.2)
    # a queue longer than the load hides it: p1 queued 0.05 s starts computing at 0.05 s
    pl = choose(pol, matched, {"p0": 0.1, "p1": 0.05, "p2": 0.1})
    assert pl.prefill_node.node_id == "p1" and pl.estimate.queue_s == pytest.approx(0.05)
    assert pl.estimate.load_s == pytest.approx(0.008) and pl.estimate.prefill_s == pytest.approx(0.2)
    assert pl.estimate.compute_s == pytest.approx(0.2)


def test_a_disk_hit_is_worth_what_the_disk_is_measured_to_cost():
    matched = {"p2": PrefixMatch(8, disk=8)}
    busy = {"p0": 5.0, "p1": 5.0}
    # fast disk: 0.8 MB at 1 GB/s + 0.2 s compute beats p3's 1 s of compute
    assert choose(TtftPolicy(book(disk_bw=1e9), short_prompt_tokens=0), matched, busy).prefill_node.node_id == "p2"
    # a disk slower than recomputing (0.8 MB at 100 KB/s: 8 s): p3 computes the whole prompt
    pl = choose(TtftPolicy(book(disk_bw=1e5), short_prompt_tokens=0), matched, busy)
    assert pl.prefill_node.node_id == "p3" and pl.predicted_cached_tokens == 0
    # the book learns the disk: reports of a fast one make the disk hit worth taking again
    costs = book(disk_bw=1e5)
    for _ in range(5):
        costs.add_onboard("p2", "disk", 4e6, 4e6 / 2e9)
    assert costs.onboard_s("p2", "disk", 800) < 0.01
    assert choose(TtftPolicy(costs, short_prompt_tokens=0), matched, busy).prefill_node.node_id == "p2"


def test_a_remote_hit_is_fetched_when_that_beats_computing_it():
    matched = {"p0": PrefixMatch(8)}
    busy = {"p0": 2.0, "p1": 2.0, "p2": 2.0}
    # p0 holds 8 blocks but is busy; p3 idle, holds nothing. Fetch: 0.8 MB at 25 GB/s.
    pl = choose(TtftPolicy(book(), short_prompt_tokens=0, replicate=True), matched, busy)
    assert (pl.prefill_node.node_id, pl.fetch_from, pl.fetch_tokens) == ("p3", "p0", 800)
    assert pl.predicted_cached_tokens == 800 and pl.kind == "disaggregated_fetch"
    assert pl.estimate.prefill_s == pytest.approx(0.2 + 800 * KVB / 25e9)
    assert pl.estimate.load_s == pytest.approx(800 * KVB / 25e9)
    # without replicate: p3 computes all of it (1 s) rather than wait 2 s for p0
    pl = choose(TtftPolicy(book(), short_prompt_tokens=0), matched, busy)
    assert (pl.prefill_node.node_id, pl.fetch_from, pl.predicted_cached_tokens) == ("p3", None, 0)
    # a path slower than computing (0.8 MB at 100 KB/s: 8 s): no fetch
    pl = choose(TtftPolicy(book(net_bw=1e5), short_prompt_tokens=0, replicate=True), matched, busy)
    assert (pl.prefill_node.node_id, pl.fetch_from) == ("p3", None)


def test_a_fetch_from_a_holders_disk_pays_its_read():
    busy = {"p0": 2.0, "p1": 2.0, "p2": 2.0}
    slow_disk = TtftPolicy(book(disk_bw=1e5), short_prompt_tokens=0, replicate=True)
    # the holder keeps the 8 blocks on its disk: reading them there takes 8 s, so p3 computes
    pl = choose(slow_disk, {"p0": PrefixMatch(8, disk=8)}, busy)
    assert (pl.prefill_node.node_id, pl.fetch_from) == ("p3", None)
    # the same blocks in the holder's memory: fetched
    pl = choose(slow_disk, {"p0": PrefixMatch(8, host=8)}, busy)
    assert (pl.prefill_node.node_id, pl.fetch_from, pl.fetch_tokens) == ("p3", "p0", 800)
    # a node that holds the head itself fetches only the rest, from the longest holder
    pl = choose(slow_disk, {"p0": PrefixMatch(8), "p1": PrefixMatch(9), "p3": PrefixMatch(4)}, busy)
    assert (pl.prefill_node.node_id, pl.fetch_from, pl.fetch_tokens, pl.predicted_cached_tokens) == ("p3", "p1", 500,
                                                                                                     900)


def test_plain_block_counts_read_as_device_hits():
    pol = TtftPolicy(book(host_bw=1e6), short_prompt_tokens=0)
    for matched in ({"p1": 6}, {"p1": PrefixMatch(6)}):
        pl = choose(pol, matched)
        assert (pl.prefill_node.node_id, pl.predicted_cached_tokens) == ("p1", 600)
        assert pl.estimate.prefill_s == pytest.approx(0.4)


def test_the_compute_term_does_not_multiply_a_fast_nodes_advantage():
    """Node "fast" runs at 0.8x, "slow" at 1.2x (their step reports say so). A long prompt's TTFT
    is lower on the slow node once the fast one's queue exceeds the compute difference, and the
    policy then sends it there whatever compute_weight is: the weight prices work at the
    cluster's typical speed, the same on both nodes, so only the TTFT term sees speed."""
    costs = CostBook(prior=PrefillCost(0.01, 1e-4, 0.0))
    truth = PrefillCost(0.01, 1e-4, 0.0)
    for n, speed in (("fast", 0.8), ("slow", 1.2)):
        for i in range(20):
            new = 2000 + 500 * i
            costs.add_step(n, StepReport(new, new, truth.predict(new) * speed))
    req = PlacementRequest(10_000, BS, slo_class="batch")
    fast, slow = costs.prefill("fast").predict(10_000), costs.prefill("slow").predict(10_000)
    assert slow - fast == pytest.approx(0.4 * truth.predict(10_000), rel=0.05)
    ns = [NodeInfo("fast", "prefill", "f:1", "fp", BS, 1000), NodeInfo("slow", "prefill", "s:1", "fp", BS, 1000),
          NodeInfo("d0", "decode", "d0:1", "fp", BS, 1000)]
    for weight in (0.0, 4.0):
        pol = TtftPolicy(costs, short_prompt_tokens=0, compute_weight=weight)
        behind = {"fast": 1.2 * (slow - fast), "slow": 0.0, "d0": 0.0}
        assert pol.choose(req, ns, {}, behind).prefill_node.node_id == "slow", weight
        ahead = {"fast": 0.8 * (slow - fast), "slow": 0.0, "d0": 0.0}
        assert pol.choose(req, ns, {}, ahead).prefill_node.node_id == "fast", weight


def test_a_decode_node_holding_all_but_a_few_tokens_prefills_them_itself():
    """Dynamo's local prefill by uncached length: d0 holds 9 of the 10 blocks (a follow-up turn
    of a conversation it decoded), so 100 tokens remain; with a threshold above that, d0
    computes them and nothing is transferred; at or below it, the pair is disaggregated."""
    matched = {"d0": PrefixMatch(9), "p0": PrefixMatch(0)}
    local = choose(TtftPolicy(book(), short_prompt_tokens=0, local_uncached_tokens=101), matched, ids=("p0",))
    assert local.prefill_node is None and local.decode_node.node_id == "d0"
    assert local.predicted_cached_tokens == 900 and "100 uncached < 101" in local.reason
    for threshold in (0, 100):  # 0: off; 100 is not above the 100 uncached tokens
        pl = choose(TtftPolicy(book(), short_prompt_tokens=0, local_uncached_tokens=threshold), matched, ids=("p0",))
        assert pl.prefill_node is not None and pl.prefill_node.node_id == "p0"
    # the rule looks at decode nodes only: a prefill node holding the prefix does not make it local
    pl = choose(TtftPolicy(book(), short_prompt_tokens=0, local_uncached_tokens=101), {"p0": PrefixMatch(9)},
                ids=("p0",))
    assert pl.prefill_node.node_id == "p0"
