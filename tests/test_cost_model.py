"""Cost models fitted online from synthetic step reports: no sockets."""
from __future__ import annotations

import random

import pytest

from kv_index.nodes import StepReport
from router.cost_model import CostBook, OnlineFit, PrefillCost, PrefillCostFit, solve


def test_solve_3x3_and_singular_direction():
    assert solve([[2, 0, 0], [0, 4, 0], [0, 0, 1]], [2, 8, 3]) == pytest.approx([1, 2, 3])
    # No information about the last coefficient: it stays 0 instead of blowing up.
    assert solve([[1, 0, 0], [0, 1, 0], [0, 0, 0]], [5, 6, 0]) == pytest.approx([5, 6, 0])


def test_prefill_cost_formula():
    m = PrefillCost(fixed_s=0.01, per_token_s=1e-4, attn_s=1e-8)
    # 1000 new tokens over 3000 cached: attention sees on average 3000 + 500 tokens.
    assert m.predict(1000, 3000) == pytest.approx(0.01 + 0.1 + 1e-8 * 1000 * 3500)
    assert m.predict(0, 5000) == 0.0  # a full hit computes nothing


def test_fit_recovers_true_constants_from_noisy_reports():
    true = PrefillCost(fixed_s=0.03, per_token_s=2.0e-4, attn_s=4.0e-9)
    fit = PrefillCostFit(prior=PrefillCost())  # the prior is off by 2-4x on every term
    rng = random.Random(0)
    for _ in range(400):
        new = rng.randint(16, 16000)
        cached = rng.choice([0, 0, rng.randint(0, 30000)])
        fit.add(StepReport(new, cached + new, true.predict(new, cached) * rng.uniform(0.97, 1.03)))
    got = fit.model
    assert got.fixed_s == pytest.approx(true.fixed_s, rel=0.25)
    assert got.per_token_s == pytest.approx(true.per_token_s, rel=0.05)
    assert got.attn_s == pytest.approx(true.attn_s, rel=0.15)
    for new, cached in [(4000, 0), (2000, 20000)]:
        assert got.predict(new, cached) == pytest.approx(true.predict(new, cached), rel=0.05)
    # A short prompt is mostly the intercept, which +-3% noise on multi-second reports barely
    # pins down: there the (scaled) prior still shows.
    assert got.predict(100, 0) == pytest.approx(true.predict(100, 0), rel=0.1)


def test_clustered_reports_keep_the_slope_of_the_scaled_prior():
    """Chat-like reports (30-55 tokens) on a node 40x slower than the prior: the data fixes
    the level, not the slope; the fit must still charge for tokens, or a cached prefix is
    worth nothing to placement."""
    true = PrefillCost(fixed_s=0.1, per_token_s=3.5e-3, attn_s=0.0)
    fit = PrefillCostFit(prior=PrefillCost())
    rng = random.Random(1)
    for _ in range(9):
        new = rng.randint(30, 55)
        fit.add(StepReport(new, new, true.predict(new) * rng.uniform(0.8, 1.2)))
    m = fit.model
    assert fit.scale > 10
    # 223 new tokens vs 15 new over a cached 208: the cached placement must look much cheaper.
    assert m.predict(223) - m.predict(15, 208) > 0.25 * (true.predict(223) - true.predict(15))


def test_prior_holds_until_reports_arrive_and_full_hits_are_ignored():
    fit = PrefillCostFit(prior=PrefillCost())
    assert fit.model == PrefillCost()
    fit.add(StepReport(0, 4096, 0.002))  # nothing computed: no information on compute cost
    assert fit.num_reports == 0 and fit.model == PrefillCost()


def test_forgetting_follows_a_node_that_slows_down():
    base = PrefillCost(0.01, 1e-4, 0.0)
    fit = PrefillCostFit(prior=base, forget=0.98)
    for i in range(300):
        new = 500 + 37 * (i % 50)
        fit.add(StepReport(new, new, base.predict(new)))
    slow = PrefillCost(0.02, 2e-4, 0.0)
    for i in range(300):
        new = 500 + 37 * (i % 50)
        fit.add(StepReport(new, new, slow.predict(new)))
    assert fit.model.predict(2000) == pytest.approx(slow.predict(2000), rel=0.05)


def test_online_fit_is_plain_least_squares_without_forgetting():
    f = OnlineFit(2, forget=1.0)
    for x in range(10):
        f.add((1.0, float(x)), 3.0 + 2.0 * x)
    assert f.coef() == pytest.approx([3.0, 2.0])


def test_cost_book_per_node_models_and_pair_bandwidth():
    book = CostBook(prior=PrefillCost(), default_bandwidth=10e9, kv_bytes_per_token=1000, bandwidth_alpha=0.5)
    assert book.prefill("never-seen") == PrefillCost()
    assert book.transfer_s("a", "b", 10_000) == pytest.approx(1e7 / 10e9)
    assert book.transfer_s("a", "a", 10_000) == 0.0
    book.add_transfer("a", "b", 2_000_000_000, 1.0)  # 2 GB/s measured
    assert book.bandwidth("a", "b") == pytest.approx(2e9)
    book.add_transfer("a", "b", 4_000_000_000, 1.0)  # EWMA halfway to 4 GB/s
    assert book.bandwidth("a", "b") == pytest.approx(3e9)
    assert book.bandwidth("b", "a") == 10e9  # pairs are directed
    # few reports: every node gets the pooled fit; enough: p0 gets its own
    book = CostBook(prior=PrefillCost(), min_reports=3)
    book.add_step("p0", StepReport(1000, 1000, 5.0))
    assert book.prefill("p0") == book.prefill("p1") != PrefillCost()
    for _ in range(3):
        book.add_step("p0", StepReport(1000, 1000, 5.0))
    book.add_step("p2", StepReport(1000, 1000, 0.5))  # a faster peer moves the pooled fit only
    assert book.prefill("p0").predict(1000) > book.prefill("p1").predict(1000) == book.prefill("p2").predict(1000)


def test_transfer_predictions_use_the_measured_model_bytes_per_token():
    book = CostBook(kv_bytes_per_token=131072)
    # A small model: 64 token slots moved in 64 KiB at 1 GB/s.
    book.add_transfer("a", "b", 65536, 65536 / 1e9, num_tokens=64)
    assert book.kv_bytes_per_token == 1024
    assert book.transfer_s("a", "b", 1000) == pytest.approx(1000 * 1024 / 1e9)
