"""The planner undoes a role switch that measured worse than the layout it left, under a load no
heavier (router/planner/decide.py, ``_rollback``): pure logic over real recorded rounds and
hand-built ones; no model, no socket."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from router.planner.config import PlannerConfig
from router.planner.decide import HOLD, SWITCH_ROLES, PlannerState, decide
from router.planner.record import read_rounds
from tests.test_planner import COLOCATED, _finished, signals

# The elastic benchmark's planner settings (deploy/bench/serve_elastic.py), one round to confirm.
BENCH = PlannerConfig(interval_s=2.0, cooldown_s=8.0, window_s=30.0, tpot_slo_factor=3.0, confirm_rounds=1,
                      slo_band=(2 / 3, 1.0, 4 / 3))


def _rounds():
    """Six rounds of the held-out seed-6 run's elastic pass 1 (2026-12-03), in order: a threshold
    change; 34 s on, 1P+1D -> colocated at 40% documents (83% of 14 requests measured within
    their SLOs); 30 s on, colocated measured 62% of 16 at the same load (the recorded planner held
    on ``no_gain`` for 108 s more); a threshold change; colocated -> 1P+1D as the phases began;
    16 s on, 1P+1D measured worse, but under 35% more requests per second."""
    return [s for s, _ in read_rounds(str(Path(__file__).parent / "data" / "planner_rounds_rollback.jsonl"))]


def test_a_switch_measured_worse_under_the_same_load_is_undone():
    set_before, switch, worse, _, _, _ = _rounds()
    moved = decide(switch, PlannerState(last_action_at=set_before.at), BENCH)
    assert (moved.action, moved.layout.prefill, moved.layout.decode) == (SWITCH_ROLES, 0, 2), moved.detail
    st = moved.state
    assert st.left == (1, 1) and st.left_attainment == pytest.approx(0.8333, abs=1e-3)
    assert st.left_load == pytest.approx((0.6, 166.3), abs=0.1)  # requests, prompt tokens a second since set_before
    back = decide(worse, st, BENCH)
    assert (back.action, back.reason) == (SWITCH_ROLES, "measured_worse"), back.detail
    assert (back.layout.prefill, back.layout.decode) == (1, 1)
    assert "measured 62% over 16 requests" in back.detail and "against 83% before it" in back.detail
    assert back.figures["measured_current_attainment"] < st.left_attainment - BENCH.switch_margin
    # Undone, the left layout is the one just left: going there again needs the evidence again.
    assert back.state.left == (0, 2) and back.state.left_attainment == pytest.approx(0.625, abs=1e-3)
    # What the model alone said on that round: stay.
    assert decide(worse, replace(st, left_attainment=None), BENCH).reason == "no_gain"


def test_a_worse_share_under_a_heavier_load_is_not_blamed_on_the_layout():
    _, _, _, set_before, switch, heavier = _rounds()
    moved = decide(switch, PlannerState(last_action_at=set_before.at), BENCH)
    assert (moved.action, moved.layout.prefill, moved.layout.decode) == (SWITCH_ROLES, 1, 1), moved.detail
    d = decide(heavier, moved.state, BENCH)
    assert d.figures["measured_current_attainment"] < moved.state.left_attainment - BENCH.switch_margin
    assert heavier.offered_since(moved.state.left_at)[0] > moved.state.left_load[0] * 1.3
    assert d.action == HOLD and d.reason != "measured_worse", d.detail


def test_rollback_needs_enough_requests_a_fresh_switch_and_a_clear_margin():
    """Hand-built: colocated after a switch from 1P+1D, every request missing its TPOT target."""
    cfg = PlannerConfig(confirm_rounds=1, cooldown_s=0.0, window_s=30.0, calibrate=False)
    s = _finished(signals(0.1, 0.6, roles=COLOCATED), 1.0)  # chat-heavy: the model keeps colocated
    load = s.offered_since(980.0)
    left = PlannerState(last_action_at=980.0, left=(1, 1), left_at=980.0, left_attainment=0.9, left_load=load)
    assert decide(s, replace(left, left_attainment=None), cfg).reason == "no_gain"  # the model's word alone
    d = decide(s, left, cfg)
    assert (d.action, d.reason, (d.layout.prefill, d.layout.decode)) == (SWITCH_ROLES, "measured_worse", (1, 1))
    # A fine share within the margin of what was left: stay.
    fine = _finished(signals(0.1, 0.6, roles=COLOCATED), 0.01)
    assert decide(fine, replace(left, left_attainment=0.95), cfg).reason == "no_gain"
    # Three requests measured since the action: too few to judge.
    assert decide(s, replace(left, last_action_at=995.0), cfg).reason != "measured_worse"
    # Two windows after the switch: the model decides again.
    assert decide(s, replace(left, left_at=940.0, last_action_at=940.0), cfg).reason == "no_gain"
    # Half the load back then: today's is heavier, the layout is not to blame.
    assert decide(s, replace(left, left_load=(load[0] / 2, load[1])), cfg).reason == "no_gain"
    assert decide(s, replace(left, left_load=(load[0], load[1] / 2)), cfg).reason == "no_gain"


def test_after_an_undo_the_planner_does_not_go_back_on_a_share_within_the_noise():
    """Four rounds of the held-out seed-7 run's elastic pass 1 (2026-12-03): a threshold change;
    24 s on, 1P+1D (88% of 11) -> colocated at 20% documents; 26 s on, colocated measured 71% of 8
    and the switch was undone; 12 s on, 1P+1D had measured 69% of 12 and the recorded planner
    went colocated again (a third switch in 38 s). Two points on 8-12 requests are noise: it
    holds (``revisit``) until one layout measures ``switch_margin`` worse than the other."""
    rounds = [s for s, _ in read_rounds(str(Path(__file__).parent / "data" / "planner_rounds_rollback_seed7.jsonl"))]
    set_before, switch, worse, back_again = rounds
    st = decide(switch, PlannerState(last_action_at=set_before.at), BENCH).state
    undo = decide(worse, st, BENCH)
    assert (undo.action, undo.reason) == (SWITCH_ROLES, "measured_worse"), undo.detail
    assert "measured 71% over 8 requests" in undo.detail and "against 88% before it" in undo.detail
    d = decide(back_again, undo.state, BENCH)
    assert (d.action, d.reason) == (HOLD, "revisit"), d.detail
    assert "at 71% measured, now 69%: not 15% worse" in d.detail
    assert "-> 2 colocated" in d.detail  # what the model wanted: colocated again
