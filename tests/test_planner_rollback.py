"""The planner undoes a role switch that measured worse than the layout it left, under a load no
heavier (router/planner/returns.py, ``rollback_reason``), and judges a layout only by requests it
served from their arrival (``measured_from``): pure logic over real recorded rounds and
hand-built ones; no model, no socket."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from router.planner.config import PlannerConfig
from router.planner.decide import HOLD, SWITCH_ROLES, PlannerState, decide
from router.planner.model import measured_share, slo_targets
from router.planner.record import read_rounds
from router.planner.signals import RequestSample, RequestWindow
from tests.test_planner import COLOCATED, _finished, signals

# The elastic benchmark's planner settings (bench/serve/elastic/run.py), one round to confirm.
BENCH = PlannerConfig(interval_s=2.0, cooldown_s=8.0, window_s=30.0, tpot_slo_factor=3.0, confirm_rounds=1,
                      slo_band=(2 / 3, 1.0, 4 / 3))


DATA = Path(__file__).parent / "data"


def _rounds(name: str = "planner_rounds_rollback.jsonl"):
    return [s for s, _ in read_rounds(str(DATA / name))]


def _chain(rounds, state: PlannerState):
    """The decisions of ``rounds`` in order, each round's state the previous decision's."""
    out = []
    for s in rounds:
        d = decide(s, state, BENCH)
        out.append(d)
        state = d.state
    return out


def test_a_switch_measured_worse_under_the_same_load_is_undone():
    """Four rounds of the held-out seed-6 run's elastic pass 1 (2026-12-03): a threshold change;
    34 s on, 1P+1D -> colocated at 40% documents (83% of 14 requests measured within their
    SLOs); 2 s on, the switch seen done; 30 s on, colocated measured 67% of the 10 requests that
    arrived after that, at the same load (the recorded planner held on ``no_gain`` for 108 s
    more)."""
    set_before, switch, done, worse = _rounds()[:4]
    moved, seen, back = _chain([switch, done, worse], PlannerState(last_action_at=set_before.at))
    assert (moved.action, moved.layout.prefill, moved.layout.decode) == (SWITCH_ROLES, 0, 2), moved.detail
    st = moved.state
    assert st.left == (1, 1) and st.left_attainment == pytest.approx(0.8333, abs=1e-3) and st.settled_at is None
    assert st.left_load == pytest.approx((0.6, 166.3), abs=0.1)  # requests, prompt tokens a second since set_before
    assert seen.state.settled_at == done.at  # the first round on the new mix with no node draining
    assert (back.action, back.reason) == (SWITCH_ROLES, "measured_worse"), back.detail
    assert (back.layout.prefill, back.layout.decode) == (1, 1)
    assert "measured 67% over 10 requests that arrived after the switch was done" in back.detail
    assert "against 83% before it" in back.detail
    # 16 had finished since the switch began: 6 of them arrived before it was done, not counted.
    assert sum(r.done and r.at >= switch.at for r in worse.requests) == 16
    # Undone, the left layout is the one just left: going there again needs the evidence again.
    assert back.state.left == (0, 2) and back.state.left_attainment == pytest.approx(0.6667, abs=1e-3)
    assert back.state.settled_at is None
    # What the model alone said on that round: stay.
    assert decide(worse, replace(seen.state, left_attainment=None), BENCH).reason == "no_gain"
    # Not before the switch is seen done: with no round in between, no undo on that evidence.
    assert decide(worse, st, BENCH).reason != "measured_worse"


def test_a_worse_share_under_a_heavier_load_is_not_blamed_on_the_layout():
    """Four more rounds of that run: a threshold change; colocated -> 1P+1D as the phases
    began; 12 s on, the switch seen done; 26 s on, 1P+1D measured 38% of 8 requests (against
    82%), but under twice the requests a second."""
    set_before, switch, done, heavier = _rounds()[4:]
    moved, _, d = _chain([switch, done, heavier], PlannerState(last_action_at=set_before.at))
    assert (moved.action, moved.layout.prefill, moved.layout.decode) == (SWITCH_ROLES, 1, 1), moved.detail
    assert d.figures["measured_current_requests"] >= BENCH.calibration_min_samples
    assert d.figures["measured_current_attainment"] < moved.state.left_attainment - BENCH.switch_margin
    assert heavier.offered_since(moved.state.left_at)[0] > moved.state.left_load[0] * 1.3
    assert d.action == HOLD and d.reason != "measured_worse", d.detail


def test_requests_served_across_a_switch_do_not_measure_the_new_layout():
    """Five rounds of the seed-7 rerun's elastic pass 2 (2026-12-03): the last action; colocated
    -> 1P+1D at 40% documents (56% of 13 measured); a round draining; 10 s on, the switch seen
    done; 12 s on, 9 requests had finished since it began, at 30% within their SLOs, and the
    recorded planner undid it (``measured_worse``): but 8 of the 9 arrived before the switch
    (queued through the drain) and none after it was done. Now: no undo, no return on them."""
    last, switch, draining, done, after = _rounds("planner_rounds_rollback_seed7_again.jsonl")
    moved, wait, seen, d = _chain([switch, draining, done, after], PlannerState(last_action_at=last.at))
    assert (moved.action, moved.layout.prefill, moved.layout.decode) == (SWITCH_ROLES, 1, 1), moved.detail
    assert (wait.reason, wait.state.settled_at) == ("switching", None)
    assert seen.state.settled_at == done.at
    finished = [r for r in after.requests if r.done and r.at >= switch.at]
    assert len(finished) == 9 and sum(r.arrived_at < switch.at for r in finished) == 8
    assert measured_share(after, BENCH.ttft_slo_factor, BENCH.tpot_slo_factor, since=switch.at,
                          band=BENCH.slo_band)[0] < 0.5641 - BENCH.switch_margin  # the old evidence
    assert d.figures["measured_current_requests"] == 0
    assert d.action == HOLD and d.reason == "revisit", d.detail  # the model wanted colocated again
    assert "0 requests measured since, 8 needed to compare" in d.detail


def test_arrival_is_read_back_from_a_finished_requests_latencies():
    r = RequestSample(100.0, 50, 0, 11, ttft_s=2.0, tpot_s=0.5)
    assert r.arrived_at == pytest.approx(100.0 - 2.0 - 10 * 0.5)
    assert replace(r, output_tokens=1, tpot_s=None).arrived_at == pytest.approx(98.0)
    assert replace(r, ttft_s=None, tpot_s=None).arrived_at == 100.0  # failed before its first token
    assert replace(r, done=False, ttft_s=None, tpot_s=None).arrived_at == 100.0  # in flight: placed then


def test_rollback_needs_enough_requests_a_fresh_switch_and_a_clear_margin():
    """Hand-built: colocated after a switch from 1P+1D, every request missing its TPOT target."""
    cfg = PlannerConfig(confirm_rounds=1, cooldown_s=0.0, window_s=60.0, calibrate=False)
    s = _finished(signals(0.1, 0.6, roles=COLOCATED), 1.0)  # chat-heavy: the model keeps colocated
    load = s.offered_since(900.0)
    left = PlannerState(last_action_at=900.0, left=(1, 1), left_at=900.0, left_attainment=0.9, left_load=load,
                        settled_at=904.0)
    assert decide(s, replace(left, left_attainment=None), cfg).reason == "no_gain"  # the model's word alone
    d = decide(s, left, cfg)
    assert (d.action, d.reason, (d.layout.prefill, d.layout.decode)) == (SWITCH_ROLES, "measured_worse", (1, 1))
    assert "over 14 requests that arrived after the switch was done" in d.detail
    # A fine share within the margin of what was left: stay.
    fine = _finished(signals(0.1, 0.6, roles=COLOCATED), 0.01)
    assert decide(fine, replace(left, left_attainment=0.95), cfg).reason == "no_gain"
    # Done later: the requests finished since arrived before it (chat answers run 64-128 s at 1 s
    # a token), too few to judge; not seen done at all: no undo.
    assert decide(s, replace(left, settled_at=990.0), cfg).reason != "measured_worse"
    assert decide(s, replace(left, settled_at=None), cfg).reason != "measured_worse"
    # Two windows after the switch: the model decides again.
    assert decide(s, replace(left, left_at=870.0, last_action_at=870.0, settled_at=872.0), cfg).reason == "no_gain"
    # Half the load back then: today's is heavier, the layout is not to blame.
    assert decide(s, replace(left, left_load=(load[0] / 2, load[1])), cfg).reason == "no_gain"
    assert decide(s, replace(left, left_load=(load[0], load[1] / 2)), cfg).reason == "no_gain"


def test_after_an_undo_the_planner_does_not_go_back_on_requests_served_across_it():
    """Six rounds of the held-out seed-7 run's elastic pass 1 (2026-12-03): a threshold change;
    24 s on, 1P+1D (88% of 11) -> colocated at 20% documents; 6 s on, seen done; 20 s on,
    colocated measured 71% of the 8 requests finished since the switch and the recorded planner
    undid it, but only 1 of them arrived after the switch: now it holds. The recorded run went
    on: undone (2 s on, seen done), and 12 s on, back to colocated on 69% of 12 finished since the
    undo (a third switch in 38 s), 1 of them arrived after it: now it holds."""
    set_before, switch, done, worse, undone, back_again = _rounds("planner_rounds_rollback_seed7.jsonl")
    moved, seen, held = _chain([switch, done, worse], PlannerState(last_action_at=set_before.at))
    assert seen.state.settled_at == done.at
    assert sum(r.done and r.at >= switch.at for r in worse.requests) == 8
    assert held.figures["measured_current_requests"] == 1 and held.reason != "measured_worse", held.detail
    assert held.action == HOLD
    # As the recorded run went on: the undo made (its state as decide() leaves it), seen done.
    undo = replace(seen.state, last_action_at=worse.at, left=(0, 2), left_at=worse.at, settled_at=None,
                   left_attainment=0.7083, left_load=worse.offered_since(switch.at), pending=None, pending_rounds=0)
    first, d = _chain([undone, back_again], undo)
    assert (first.action, first.reason) == (HOLD, "revisit"), first.detail  # the model: colocated again
    assert "0 requests measured since, 8 needed to compare" in first.detail
    assert sum(r.done and r.at >= worse.at for r in back_again.requests) == 12
    assert d.figures["measured_current_requests"] == 1
    assert d.action == HOLD, d.detail  # uncalibrated on one request, the model no longer wants colocated


def _late(at: float, waited: float, first_token: bool = False, watched: bool = True, prompt: int = 100,
          output: int = 64) -> RequestSample:
    """A request in flight, placed at ``at``, that has waited ``waited`` seconds for its first
    token by the round (``first_token``: it came then)."""
    return RequestSample(at, prompt, 0, output, waited if first_token else None, None, done=False,
                         first_token_watched=watched)


def _ttft_target(s, band: float = 1.0, factor: float = 5.0, prompt: int = 100) -> float:
    r = RequestSample(s.at, prompt, 0, 64, None, None)
    return slo_targets(r, s, s.prefill.predict(prompt, 0), band * factor, 1.0)[0]


def test_requests_in_flight_past_their_ttft_target_count_as_misses():
    """A request still running whose first token came late, or has not come by its TTFT target,
    is a miss whatever comes next: ``measured_share`` counts it before it finishes. One under
    its target so far, one from a recording made before the router watched first tokens, and
    one that arrived before the layout measured are not counted."""
    s = replace(_finished(signals(0.0, 0.5), 0.06), unloaded_tpot_s=0.05)  # 60 finished, all within
    target = _ttft_target(s, band=4 / 3)  # the widest of the band below
    late = [_late(990.0, target + 1.0, first_token=True),  # first token late, still decoding
            _late(s.at - target - 1.0, target + 1.0)]  # no first token, waiting past its target
    not_yet = [_late(s.at - target / 2, target / 2),  # waiting, under its target so far
               _late(995.0, target / 2, first_token=True),  # first token in time
               _late(s.at - target - 1.0, target + 1.0, watched=False)]  # an old recording's
    both = replace(s, requests=(*s.requests, *late, *not_yet))
    band = (2 / 3, 1.0, 4 / 3)
    assert measured_share(s, tpot_slo_factor=2.0, band=band) == (pytest.approx(1.0), 60)
    assert measured_share(both, tpot_slo_factor=2.0, band=band) == (pytest.approx(60 / 62), 62)
    # Arrived before the layout ran (the switch seen done at 991): served across it, not counted.
    share, n = measured_share(both, tpot_slo_factor=2.0, band=band, since=985.0, arrived_since=991.0)
    assert n == 1 + sum(r.done and r.at >= 985.0 and r.arrived_at >= 991.0 for r in s.requests)
    # Late at the tightest target only: may yet count as met at the widest, not counted.
    edge = replace(s, requests=(*s.requests, _late(990.0, _ttft_target(s, band=2 / 3) + 0.01, first_token=True)))
    assert measured_share(edge, tpot_slo_factor=2.0, band=band) == (pytest.approx(1.0), 60)


def test_the_window_records_a_first_token_on_the_request_in_flight():
    w = RequestWindow()
    w.started("a", RequestSample(100.0, 64, 0, 128, None, None, done=False, first_token_watched=True))
    w.first_token("a", 1.5)
    w.first_token("gone", 2.0)  # ended before its first token reached the window: nothing to mark
    (r,) = w.recent(101.0, 30.0, 1)
    assert (r.ttft_s, r.done, r.at, r.arrived_at) == (1.5, False, 100.0, 100.0)
    w.ended("a")
    w.first_token("a", 3.0)
    assert w.recent(101.0, 30.0, 1) == ()


def test_late_requests_in_flight_send_the_planner_back_before_eight_finish():
    """After a switch 1P+1D -> colocated at 40% documents, the documents queue: 3 requests that
    arrived after the switch was done finished, 8 more are in flight past their TTFT target.
    Before, ``revisit`` held the model's return to 1P+1D until 8 had finished (18-22 s in the
    held-out seed-6 run's documents phase, 2026-12-03); the 11 measured say colocated is worse.
    The model alone, with no switch to go back on, still waits for 8 finished ones
    (``calibrating``): the late ones are evidence against the layout, not a calibration."""
    cfg = PlannerConfig(confirm_rounds=1, cooldown_s=0.0, window_s=60.0, calibrate=False)
    base = signals(0.4, 0.5, roles=COLOCATED)
    early = [replace(r, at=r.at - 47.0) for r in base.requests[11:]]  # finished before the switch
    fin = [replace(r, at=995.0 + i, ttft_s=0.01, tpot_s=0.001, output_tokens=2) for i, r in enumerate(early[:3])]
    flying = [_late(962.0 + i * 0.5, 1000.0 - 962.0 - i * 0.5, prompt=900, output=16) for i in range(8)]  # documents
    assert min(1000.0 - x.at for x in flying) > _ttft_target(base, 4 / 3, prompt=900)  # no first token by then
    s = replace(base, requests=(*early, *fin, *flying))
    left = PlannerState(last_action_at=958.0, left=(1, 1), left_at=958.0, left_attainment=0.9,
                        left_load=s.offered_since(900.0), settled_at=960.0)
    old = replace(s, requests=tuple(replace(r, first_token_watched=False) for r in s.requests))
    held = decide(old, left, cfg)
    assert (held.action, held.reason) == (HOLD, "revisit") and "3 requests measured since, 8 needed" in held.detail
    d = decide(s, left, cfg)
    assert d.figures["measured_current_requests"] == 11
    assert d.figures["measured_current_attainment"] == pytest.approx(3 / 11, abs=1e-4)
    assert (d.action, (d.layout.prefill, d.layout.decode)) == (SWITCH_ROLES, (1, 1)), d.detail
    # No switch to go back on (the last action a threshold change): 3 finished, the model waits.
    wait = decide(s, PlannerState(last_action_at=958.0), cfg)
    assert (wait.action, wait.reason) == (HOLD, "calibrating"), wait.detail
    assert "3 requests finished since the last action, 8 needed" in wait.detail
