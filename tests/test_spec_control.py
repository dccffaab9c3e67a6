"""Adaptive speculation: k from acceptance, switching off, per-step budget (pure logic)."""
from engine.config import SpeculativeConfig
from engine.spec_control import PROBE_EVERY, SpecController, best_k, expected_tokens, step_budget


def test_expected_tokens_and_best_k():
    assert expected_tokens(0.5, 2) == 1.75
    assert best_k(0.0, 5, 0.03, 0.5) == 0
    assert best_k(0.95, 5, 0.03, 0.5) == 5
    assert 0 < best_k(0.6, 8, 0.1, 0.0) < 8  # the marginal token stops paying


def test_budget_shrinks_with_batch():
    cfg = SpeculativeConfig(method="ngram", max_tokens_per_step=32, max_batch_size=16)
    budgets = [step_budget(cfg, b) for b in (1, 4, 8, 16, 17, 64)]
    assert budgets[0] == 32 and budgets[-1] == 0 and budgets[-2] == 0
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))
    ctl = SpecController(cfg, draft_cost=0.0)
    plan = ctl.plan([f"s{i}" for i in range(12)], batch_size=12)
    assert sum(plan.values()) <= step_budget(cfg, 12)


def test_low_acceptance_switches_off_then_probes():
    ctl = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4), draft_cost=0.0)
    assert ctl.plan(["a"], 1) == {"a": 4}  # optimistic prior: speculate at once
    for _ in range(10):
        ctl.observe("a", 4, 0)
    plans = [ctl.plan(["a"], 1) for _ in range(PROBE_EVERY)]
    assert plans[:-1] == [{}] * (PROBE_EVERY - 1) and plans[-1] == {"a": 2}  # off, then a probe
    for _ in range(10):
        ctl.observe("a", 4, 4)
    assert ctl.plan(["a"], 1) == {"a": 4}


def test_non_adaptive_always_uses_k():
    ctl = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False), 0.0)
    for _ in range(5):
        ctl.observe("a", 3, 0)
    assert ctl.plan(["a", "b"], 2) == {"a": 3, "b": 3}
