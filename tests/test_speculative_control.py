"""Adaptive speculation: k from acceptance and step cost, switching off, per-step budget,
confidence buckets (pure logic)."""
import pytest

from engine.config import SpeculativeConfig
from engine.speculative.control import (
    GATE_MAX_PROBE_EVERY,
    GATE_MIN_STEPS,
    GATE_PROBE_EVERY,
    PROBE_EVERY,
    SpecController,
    StepCost,
    StepGate,
    expected_tokens,
    laggard_advance,
    step_budget,
)


def _plan_k(a: float, k_max: int, cost=None, batch: int = 1) -> int:
    """k planned for one sequence whose acceptance is a (fed as observations)."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=k_max)
    ctl = SpecController(cfg, draft_cost=0.0, step_cost=cost)
    for i in range(200):  # accepted evenly spread: a fraction a of single-token drafts
        ctl.observe("s", 1, int((i + 1) * a) - int(i * a))
    ctl.plan(["s"], 1)  # a sequence first seen before the node had data probes once; skip it
    return ctl.plan(["s"] + [f"o{i}" for i in range(batch - 1)], batch).get("s", 0)


def test_expected_tokens_and_k_from_acceptance():
    assert expected_tokens(0.5, 2) == 1.75
    assert _plan_k(0.0, 5) == 0
    assert _plan_k(0.95, 5) == 5
    assert 0 < _plan_k(0.6, 12) < 12  # the config's linear prior: the marginal token stops paying


class _Curve:
    """A measured-looking matmul curve: flat up to 4 rows, then 40% more per extra row."""

    def __call__(self, rows: int) -> float:
        return 10.0 if rows <= 4 else 10.0 + 4.0 * (rows - 4)


def test_step_cost_starts_from_the_matmul_curve_and_learns_the_rest():
    cfg = SpeculativeConfig(method="ngram")
    cost = StepCost(cfg, _Curve())
    assert cost.cost(4) == pytest.approx(cost.cost(1))  # same matmul time, same residual guess
    for _ in range(3):
        cost.observe(1, 15.0)  # residual 5 ms measured
    assert cost.cost(1) == pytest.approx(15.0)
    assert cost.cost(6) == pytest.approx(18.0 + 5.0)  # unseen: curve + learned residual
    for _ in range(3):
        cost.observe(6, 30.0)
    assert cost.cost(6) == pytest.approx(30.0)  # seen often enough: its own average
    assert cost.snapshot() == {"1": 15.0, "6+v": 30.0}
    # At batch 8 a plain step and a verifying one are different kinds: the verifying residual
    # (6 + 30 - 18 = 12 ms) is learned apart from the plain one (5 ms).
    assert cost.cost(8, verifying=False) == pytest.approx(26.0 + 5.0)
    assert cost.cost(8, verifying=True) == pytest.approx(26.0 + 0.9 * 12.0 + 0.1 * 12.0, rel=0.2)


def test_step_cost_without_a_curve_scales_the_linear_prior_to_what_it_measures():
    cfg = SpeculativeConfig(method="ngram", verify_fixed_cost=0.5, verify_token_cost=0.1)
    cost = StepCost(cfg)
    assert cost.cost(3) == pytest.approx(1.0 + 0.5 + 0.2)  # units of one decode step
    cost.observe(1, 20.0)
    assert cost.cost(3) == pytest.approx(20.0 * 1.7)


def test_k_follows_the_cost_curve():
    cost = StepCost(SpeculativeConfig(method="ngram"), _Curve())
    for _ in range(3):
        cost.observe(1, 15.0)
    # Rows 2..4 are free on this curve and every later row costs 27% of a step: any acceptance
    # takes the free rows, and even 0.97 stops there.
    assert [_plan_k(a, 8, cost) for a in (0.3, 0.6, 0.97)] == [3, 3, 3]
    gentle = StepCost(SpeculativeConfig(method="ngram"), lambda rows: 10.0 + 0.2 * max(0, rows - 4))
    for _ in range(3):
        gentle.observe(1, 15.0)
    assert _plan_k(0.97, 8, gentle) == 8
    assert _plan_k(0.0, 8, gentle) == 0


def test_compute_bound_steps_stop_speculating_as_the_batch_grows():
    # Every row costs as much as a whole batch-1 step: past a few sequences nothing pays.
    linear = StepCost(SpeculativeConfig(method="ngram"), lambda rows: 10.0 * rows)
    ks = [_plan_k(0.7, 5, linear, batch) for batch in (1, 8, 32)]
    assert ks[0] == 0 or ks[0] >= ks[1] >= ks[2]
    flat = StepCost(SpeculativeConfig(method="ngram"), lambda rows: 10.0 + 0.01 * rows)
    assert _plan_k(0.7, 5, flat, 8) > 0


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


def test_trim_cuts_each_draft_to_what_its_bucket_pays_for():
    cost = StepCost(SpeculativeConfig(method="ngram"), _Curve())
    ctl = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=8), 0.0, cost)
    for _ in range(20):
        ctl.observe("x", 4, 0, bucket=1)  # 1-token matches: always rejected
        ctl.observe("x", 8, 8, bucket=8)  # 8-token matches: always accepted
    assert ctl.bucket_acceptance(1) == 0.0 and ctl.bucket_acceptance(8) == 1.0
    assert ctl.bucket_acceptance(5) is None  # never seen: no opinion
    keep = ctl.trim([("a", 4, 1), ("b", 8, 8), ("c", 3, 5)], batch_size=3)
    assert keep == [0, 8, 3]  # weak match dropped, strong kept, unknown bucket keeps its plan
    # Reserving room is free for n-gram: a request with poor acceptance of its own still gets
    # room planned, because some bucket on this node pays.
    for _ in range(10):
        ctl.observe("a", 4, 0)
    assert ctl.plan(["a"], 1).get("a", 0) > 0


def test_trim_is_a_no_op_when_not_adaptive():
    ctl = SpecController(SpeculativeConfig(method="ngram", adaptive=False), 0.0)
    for _ in range(20):
        ctl.observe("x", 4, 0, bucket=1)
    assert ctl.trim([("a", 4, 1)], 1) == [4]


def test_a_drafter_slower_than_it_claims_is_switched_off_by_its_measured_cost():
    cost = StepCost(SpeculativeConfig(method="low_precision"), lambda rows: 15.0)
    for _ in range(3):
        cost.observe(1, 20.0)
    ctl = SpecController(SpeculativeConfig(method="low_precision", num_speculative_tokens=5), 0.1, cost)
    for _ in range(20):
        ctl.observe("old", 5, 4)  # high acceptance on this node
    assert ctl.draft_round_ms == pytest.approx(2.0)  # its claim: a tenth of a decode step
    assert ctl.plan(["a"], 1).get("a", 0) >= 3
    for _ in range(40):
        ctl.observe_draft(5, 5 * 19.0)  # measured: each round costs nearly a whole step
    assert ctl.draft_round_ms == pytest.approx(19.0, rel=0.05)
    assert ctl.plan(["b"], 1) == {}


def test_an_always_trimmed_bucket_is_probed_now_and_then():
    cost = StepCost(SpeculativeConfig(method="ngram"), _Curve())
    ctl = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=8), 0.0, cost)
    for _ in range(20):
        ctl.observe("x", 4, 0, bucket=1)
    kept = [ctl.trim([("a", 4, 1)], 1)[0] for _ in range(3 * PROBE_EVERY)]
    assert kept.count(0) == 3 * PROBE_EVERY - 3 and set(kept) == {0, ctl.probe_k}


def test_sequential_drafters_pay_for_every_sequences_rounds():
    cost = StepCost(SpeculativeConfig(method="eagle"), lambda rows: 15.0 + 0.1 * rows)
    for _ in range(3):
        cost.observe(1, 20.0)

    def planned(batched):
        ctl = SpecController(SpeculativeConfig(method="eagle", num_speculative_tokens=4), 0.1, cost, batched=batched)
        for _ in range(20):
            ctl.observe("old", 4, 4)
        return sum(ctl.plan([f"s{i}" for i in range(6)], 6).values())

    # Six sequences at 2 ms a round: batched rounds are shared and all six draft 4 tokens;
    # sequential rounds add up, and only half of them still pay.
    assert (planned(True), planned(False)) == (24, 12)


def test_one_slow_first_call_moves_the_draft_cost_estimate_at_most_4x():
    ctl = SpecController(SpeculativeConfig(method="draft"), 0.5, StepCost(SpeculativeConfig(method="draft")))
    before = ctl.draft_round_ms  # 0.5 of a (unit) decode step
    ctl.observe_draft(1, 1000.0)  # a draft prefill over a long prompt
    assert ctl.draft_round_ms == pytest.approx(0.9 * before + 0.1 * 4 * before)


# ---- the step gate: whole steps' measured yield, verifying vs plain, per batch size --------


def test_gate_allows_until_verifying_steps_are_judged_then_keeps_paying_ones():
    gate = StepGate(lambda b: 10.0)  # a plain step of any size: 10 ms (prediction)
    for _ in range(GATE_MIN_STEPS - 1):
        assert gate.allow(1)
        gate.observe(1, tokens=1, ms=30.0, verifying=True)  # awful, but not judged yet
    assert gate.allow(1)
    gate2 = StepGate(lambda b: 10.0)
    for _ in range(GATE_MIN_STEPS):
        gate2.observe(1, tokens=3, ms=15.0, verifying=True)  # 0.2 tokens/ms vs 0.1 plain
    assert all(gate2.allow(1) for _ in range(100))
    assert gate2.snapshot() == {"1": 2.0}


def test_gate_turns_speculation_off_where_verifying_steps_yield_less_and_probes_with_back_off():
    gate = StepGate(lambda b: 40.0)
    for _ in range(GATE_MIN_STEPS):
        gate.observe(8, tokens=9, ms=50.0, verifying=True)  # 0.18 tokens/ms
    for _ in range(3):
        gate.observe(8, tokens=8, ms=30.0, verifying=False)  # measured plain: 0.27 tokens/ms
    allowed = []
    for _ in range(200):
        ok = gate.allow(8)
        allowed.append(bool(ok))
        if ok:  # the probe still loses
            gate.observe(8, tokens=9, ms=50.0, verifying=True)
    waits = [j - i for i, j in zip([-1] + [i for i, a in enumerate(allowed) if a],
                                   [i for i, a in enumerate(allowed) if a])]
    assert waits[0] == GATE_PROBE_EVERY and waits[1] == 2 * GATE_PROBE_EVERY
    assert max(waits) == GATE_MAX_PROBE_EVERY and sum(allowed) <= 6
    assert gate.allow(1)  # another batch size has its own verdict


def test_gate_compares_with_the_predicted_plain_step_until_one_is_measured():
    gate = StepGate(lambda b: 20.0 + b)  # predicted plain step of 8 rows: 28 ms -> 0.286 tokens/ms
    for _ in range(GATE_MIN_STEPS):
        gate.observe(8, tokens=10, ms=40.0, verifying=True)  # 0.25 tokens/ms
    # relative to the prediction: 10/8 tokens per sequence in 40/28 plain-step times
    assert gate.rates(8) == (pytest.approx((10 / 8) / (40 / 28)), 1.0)
    assert not gate.allow(8)


def test_gate_shares_a_verdict_across_a_bucket_of_batch_sizes():
    """Natural stopping shrinks a batch one by one (8, 7, 6, ...): sizes 4-7 share what was
    learned, judged relative to each size's own predicted plain step, so a losing verdict
    need not be learned again (with losing steps) at each size."""
    gate = StepGate(lambda b: 20.0 + b)
    for b in (7, 6, 5):  # one losing verifying step at each size: 0.9 of a plain step's yield
        gate.observe(b, tokens=b, ms=(20.0 + b) / 0.9, verifying=True)
    assert gate.rates(4)[0] == pytest.approx(0.9)
    assert not gate.allow(4)
    assert gate.allow(8)  # 8-15 is another bucket, not judged yet
    assert gate.snapshot() == {"4-7": 0.9}
    assert [StepGate.bucket_label(StepGate.bucket(b)) for b in (1, 2, 3, 4, 7, 8, 16)] == \
        ["1", "2-3", "2-3", "4-7", "4-7", "8-15", "16-31"]


def test_gate_measured_plain_steps_cancel_an_error_of_the_prediction():
    gate = StepGate(lambda b: 10.0)  # predicts 10 ms; this machine takes 20 ms for a plain step
    for _ in range(3):
        gate.observe(2, tokens=2, ms=20.0, verifying=False)
    for _ in range(GATE_MIN_STEPS):
        gate.observe(3, tokens=5, ms=30.0, verifying=True)  # 5/3 per seq in 30 ms: 1.11x plain's 1 in 20
    spec, plain = gate.rates(2)
    assert plain == pytest.approx(0.5) and spec == pytest.approx((5 / 3) / 3.0)
    assert gate.allow(3)


def test_a_losing_gate_comes_back_when_the_text_turns_repetitive():
    gate = StepGate(lambda b: 10.0)
    for _ in range(GATE_MIN_STEPS):
        gate.observe(1, tokens=1, ms=14.0, verifying=True)
    assert not gate.allow(1)
    n = 0
    while not gate.allow(1):
        n += 1
    assert n == GATE_PROBE_EVERY - 2  # the probe comes
    for _ in range(20):  # repetitive text: the probes pay, the decayed average recovers
        gate.observe(1, tokens=4, ms=14.0, verifying=True)
    assert gate.allow(1) and gate.allow(1)


def test_controller_plans_nothing_while_the_gate_is_off():
    ctl = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=4), draft_cost=0.0,
                         step_cost=StepCost(SpeculativeConfig(method="ngram"), lambda rows: 10.0))
    for i in range(20):
        ctl.observe(f"old{i}", 4, 4)  # acceptance looks perfect, so the per-sequence rule speculates
    seqs = [f"s{i}" for i in range(8)]
    assert sum(ctl.plan(seqs, 8).values()) > 0
    for _ in range(GATE_MIN_STEPS):
        ctl.gate.observe(8, tokens=8, ms=25.0, verifying=True)  # but whole steps yield less
    for _ in range(3):
        ctl.gate.observe(8, tokens=8, ms=12.0, verifying=False)
    assert ctl.plan(seqs, 8) == {}
    # Not adaptive: the configured k, whatever the gate has seen.
    fixed = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=2, adaptive=False), 0.0)
    for _ in range(GATE_MIN_STEPS):
        fixed.gate.observe(2, tokens=1, ms=100.0, verifying=True)
    assert fixed.plan(["a", "b"], 2) == {"a": 2, "b": 2}


def test_an_off_gate_probes_with_one_draft_of_the_best_acceptor():
    ctl = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=8), draft_cost=0.0,
                         step_cost=StepCost(SpeculativeConfig(method="ngram"), lambda rows: 10.0))
    seqs = [f"s{i}" for i in range(8)]
    for i, sid in enumerate(seqs):  # s7 accepts best
        for _ in range(10):
            ctl.observe(sid, 4, i // 2)
    for _ in range(GATE_MIN_STEPS):
        ctl.gate.observe(8, tokens=8, ms=25.0, verifying=True)
    for _ in range(3):
        ctl.gate.observe(8, tokens=8, ms=12.0, verifying=False)
    plans = [ctl.plan(seqs, 8) for _ in range(GATE_PROBE_EVERY)]
    assert plans[:-1] == [{}] * (GATE_PROBE_EVERY - 1)
    assert plans[-1] == {"s7": ctl.probe_k}  # one draft, not one per sequence



def test_laggard_advance_is_how_far_the_request_with_the_fewest_tokens_moved():
    assert laggard_advance([5, 5, 9], [6, 9, 13]) == 1  # one laggard verified nothing: 1, as a plain step
    assert laggard_advance([5, 5, 9], [8, 7, 10]) == 2  # both tied laggards got more than one
    assert laggard_advance([5, 9], [6, 10]) == 1
    assert laggard_advance([], []) == 0  # nothing left running


def test_a_whole_batch_gate_turns_off_where_tokens_only_put_requests_ahead():
    """Per token a verifying step pays (three of eight requests took 3 tokens: 1.75x the tokens
    for 1.3x the time); judged by the laggard it moved the batch's end by 1, as a plain step
    does, at 1.3x the time."""
    per_token, laggard = StepGate(lambda b: 10.0), StepGate(lambda b: 10.0)
    for _ in range(GATE_MIN_STEPS):
        per_token.observe(8, tokens=5 + 3 * 3, ms=13.0, verifying=True)
        laggard.observe(8, tokens=8 * laggard_advance([20] * 8, [21] * 5 + [23] * 3), ms=13.0, verifying=True)
    assert per_token.allow(8)
    assert not laggard.allow(8)
