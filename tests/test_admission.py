"""Admission decisions on hand-built estimates, and through TtftPolicy: no sockets."""
from __future__ import annotations

import pytest

from kv_index.nodes import NodeInfo
from router.admission import SLO_CLASSES, Estimate, SloClass, decide
from router.cost_model import CostBook, DecodeCost, PrefillCost
from router.placement import PlacementRequest, TtftPolicy

STD = SloClass("std", ttft_s=2.0, ttft_per_1k_tokens_s=0.25, tbt_s=0.1)


def test_budget_grows_with_the_prompt():
    assert STD.ttft_budget_s(0) == 2.0
    assert STD.ttft_budget_s(8000) == pytest.approx(4.0)
    assert decide(Estimate(queue_s=10.0), SLO_CLASSES["batch"], 100).admit


def test_admit_when_within_budget():
    d = decide(Estimate(queue_s=1.0, prefill_s=0.5, transfer_s=0.1, tbt_s=0.05), STD, 1000)
    assert d.admit and d.retry_after_ms is None


def test_queue_too_long_rejects_with_the_excess_as_retry_hint():
    # budget 2.25 s; predicted 1.0 + 2.0 = 3.0 s -> 750 ms too late
    d = decide(Estimate(queue_s=2.0, prefill_s=1.0), STD, 1000)
    assert not d.admit
    assert d.retry_after_ms == 750
    assert "exceeds the std SLO of 2.25 s" in d.reason


def test_hopeless_request_gets_no_retry_hint():
    # even with an empty queue the compute alone misses: retrying cannot help
    d = decide(Estimate(queue_s=0.5, prefill_s=5.0), STD, 1000)
    assert not d.admit and d.retry_after_ms is None and "even without queueing" in d.reason


def test_tbt_over_slo_rejects():
    d = decide(Estimate(prefill_s=0.1, tbt_s=0.2), STD, 100)
    assert not d.admit and "between tokens" in d.reason and d.retry_after_ms == 1000


def test_retry_hint_is_clamped():
    assert decide(Estimate(queue_s=2.2, prefill_s=0.1), STD, 0).retry_after_ms == pytest.approx(300, abs=1)
    assert decide(Estimate(queue_s=2.01, prefill_s=0.0), STD, 0).retry_after_ms == 100  # floor
    assert decide(Estimate(queue_s=500, prefill_s=0.0), STD, 0).retry_after_ms == 30_000  # ceiling


def _node(nid, role="prefill", running=0, running_tokens=0):
    return NodeInfo(nid, role, f"{nid}:1", "fp", 16, 1000, running=running, running_tokens=running_tokens)


def test_policy_estimate_feeds_admission():
    costs = CostBook(prior=PrefillCost(0.01, 1e-4, 0.0), decode=DecodeCost(0.01, 1e-3, 0.0),
                     default_bandwidth=1e12, kv_bytes_per_token=1)
    pol = TtftPolicy(costs, short_prompt_tokens=0, compute_weight=0.0)
    nodes = [_node("p0"), _node("p1"), _node("d0", "decode")]
    req = PlacementRequest(4000, 16, slo_class="standard")
    # p0 has 30 s queued, p1 has 5 s: the best pair still waits 5 s > 2 + 1 s budget
    pl = pol.choose(req, nodes, {}, {"p0": 30.0, "p1": 5.0})
    assert pl.prefill_node.node_id == "p1"
    assert pl.estimate.queue_s == 5.0 and pl.estimate.prefill_s == pytest.approx(0.41)
    verdict = decide(pl.estimate, SLO_CLASSES["standard"], 4000)
    assert not verdict.admit and verdict.retry_after_ms == pytest.approx(2410, abs=1)
    # a batch-class request waits instead
    assert decide(pl.estimate, SLO_CLASSES["batch"], 4000).admit


def test_decode_node_over_tbt_is_avoided_and_reported():
    costs = CostBook(prior=PrefillCost(0.01, 1e-4, 0.0), decode=DecodeCost(0.01, 1e-3, 0.0))
    pol = TtftPolicy(costs, short_prompt_tokens=0)
    # d0 runs 150 sequences: 0.01 + 151 ms > 100 ms; d1 runs 10
    nodes = [_node("p0"), _node("d0", "decode", running=150), _node("d1", "decode", running=10)]
    pl = pol.choose(PlacementRequest(1000, 16, slo_class="standard"), nodes, {})
    assert pl.decode_node.node_id == "d1" and pl.estimate.tbt_s == pytest.approx(0.021)
    nodes = [_node("p0"), _node("d0", "decode", running=150)]
    pl = pol.choose(PlacementRequest(1000, 16, slo_class="standard"), nodes, {})
    assert not decide(pl.estimate, SLO_CLASSES["standard"], 1000).admit
