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


def test_a_costly_drafter_that_never_pays_probes_rarely_with_one_token():
    # Early exit through half the layers: every draft token costs half a step.
    ctl = SpecController(SpeculativeConfig(method="early_exit", num_speculative_tokens=5), draft_cost=0.5)
    probes = []
    for _ in range(1000):
        plan = ctl.plan(["a"], 1)
        if plan:
            probes.append(plan["a"])
            ctl.observe("a", plan["a"], 0)
    assert probes and set(probes) == {1}
    # Waits double from 16 to 256 steps: a handful of probes in 1000 steps, not 60.
    assert len(probes) <= 9


def test_new_sequences_start_from_the_node_wide_acceptance():
    ctl = SpecController(SpeculativeConfig(method="early_exit", num_speculative_tokens=5), draft_cost=0.5)
    for i in range(20):  # earlier requests: every draft rejected
        ctl.observe(f"old{i}", 1, 0)
    assert ctl.plan(["new"], 1) == {}  # no losing first probe for the next request
    good = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4), draft_cost=0.0)
    for i in range(20):
        good.observe(f"old{i}", 4, 4)
    assert good.plan(["new"], 1) == {"new": 4}


def test_new_sequences_continue_the_node_probe_back_off():
    ctl = SpecController(SpeculativeConfig(method="early_exit", num_speculative_tokens=5), draft_cost=0.5)
    probes = 0
    for r in range(8):  # eight 128-token requests in a row, drafts always rejected
        for _ in range(128):
            plan = ctl.plan([f"r{r}"], 1)
            if plan:
                probes += 1
                ctl.observe(f"r{r}", plan[f"r{r}"], 0)
        ctl.forget(f"r{r}")
    assert probes <= 8  # ~1024 steps: first probe, then waits of 32, 64, 128, 256, 256 ...
