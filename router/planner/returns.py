"""What the planner remembers of its last role switch, and when what the layouts measured
since sends it back (router/planner/decide.py's docstring says why each rule is there):

- ``measured_from``: which of the window's requests measured the layout running now (after a
  role switch, those that arrived after it was seen done, ``seen_settled``);
- ``revisit_hold``: why not to return to the role mix the last switch left, within
  ``REVISIT_WINDOWS`` windows of it, on the model's word alone;
- ``back_on_evidence``: a return that the measured shares justify;
- ``rollback_reason``: why to undo the last switch whatever the model predicts.

Pure functions of the state, the round's signals and the config.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from router.planner.config import PlannerConfig
from router.planner.model import Layout
from router.planner.signals import PlannerSignals


@dataclass(frozen=True, slots=True)
class PlannerState:
    """What the planner carries from one round to the next."""

    last_action_at: float | None = None  # wall clock of the last action (None: never acted)
    pending: Layout | None = None  # the target that won the last rounds
    pending_rounds: int = 0
    # The role mix the last role switch left (prefill, decode nodes), and what it measured
    # then (model.measured_share; None: too few requests to say).
    left: tuple[int, int] | None = None
    left_at: float | None = None
    left_attainment: float | None = None
    # The load it measured that under: (requests, prompt tokens) per second since the action before.
    left_load: tuple[float, float] | None = None
    # When that switch was seen done: the first round with the new role mix and no node
    # draining (None: not yet). What the new mix measured counts only requests that arrived
    # after it (``measured_from``).
    settled_at: float | None = None


# Windows after a role switch during which the layout it left needs measured evidence to return.
REVISIT_WINDOWS = 2.0
# How much heavier the load since a role switch may be than before it for the switch to be
# undone on what the two layouts measured (``rollback_reason``). Not ``switch_margin``: the 15-20
# requests a window holds after a switch count a document more or less by chance, and one
# document of 768-1024 tokens moves their prompt tokens per second by ~20% (the seed-6 run's
# switch: 166 before, 190-215 after, the same 40%-documents mix at the same rate).
ROLLBACK_LOAD_TOLERANCE = 0.3


def measured_from(state: PlannerState) -> tuple[float | None, float | None]:
    """(finished since, arrived since): the window's requests that measured the layout running
    now. Those finished since the last action; after a role switch, only those that also
    arrived after it was done (``settled_at``; its start until then): a request queued before
    it and finished seconds after was served across it (the drain, a migrated stream) and
    measures the switch, not the new layout. In the recorded elastic runs, 7 of 52 role switches
    were made 12-26 s after the last one on 8-16 such requests, none of them on 8 that arrived
    after it (the held-out seed-7 runs of 2026-12-03: an undo on 9, 8 of them queued before
    the switch). A threshold change moves no request: what finished since counts."""
    if state.left_at is not None and state.left_at == state.last_action_at:
        return state.last_action_at, state.settled_at if state.settled_at is not None else state.left_at
    return state.last_action_at, None


def seen_settled(state: PlannerState, s: PlannerSignals, current: Layout) -> PlannerState:
    """``state`` with the last role switch seen done on this round: the first on a new role mix
    with no node draining (a round between the decision and the node's drain still shows the
    mix it left)."""
    if (s.draining or state.left is None or state.settled_at is not None
            or (current.prefill, current.decode) == state.left):
        return state
    return replace(state, settled_at=s.at)


def revisit_hold(state: PlannerState, target: Layout, now: float, cfg: PlannerConfig, here_att: float,
             here_n: int) -> str:
    """Why not to go back to the role mix the last switch left (module docstring; '' to go):
    within ``REVISIT_WINDOWS`` windows of it, unless the layout it moved to measured worse."""
    if state.left != (target.prefill, target.decode) or state.left_at is None:
        return ""
    ago = now - state.left_at
    if ago >= REVISIT_WINDOWS * cfg.window_s:
        return ""
    if state.left_attainment is None:
        # Left before it measured enough to compare: one window, not two, on the prediction's word
        # (a shifting workload's next phase must not wait out two windows for evidence never taken).
        if ago >= cfg.window_s:
            return ""
        return (f"left {ago:.0f} s ago before it measured {cfg.calibration_min_samples} requests: no evidence it "
                f"was better for {cfg.window_s - ago:.0f} s more")
    if here_n < cfg.calibration_min_samples:
        return (f"left {ago:.0f} s ago at {state.left_attainment:.0%} measured; {here_n} requests measured since, "
                f"{cfg.calibration_min_samples} needed to compare")
    if here_att > state.left_attainment - cfg.switch_margin:
        # Not on noise: 8-20 requests measure a share within ~0.1-0.15 of what they would over
        # many (one standard error); the held-out seed-7 run went back to colocated 12 s after
        # undoing it (``measured_worse``), 1P+1D at 69% of 12 requests against its 71% of 8.
        return (f"left {ago:.0f} s ago at {state.left_attainment:.0%} measured, now {here_att:.0%}: "
                f"not {cfg.switch_margin:.0%} worse")
    return ""


def back_on_evidence(state: PlannerState, target: Layout, cfg: PlannerConfig, here_att: float, here_n: int) -> bool:
    """The target is the role mix the last switch left, and the layout it moved to measured
    ``switch_margin`` worse than that one had, over enough requests (``revisit_hold`` lets it go)."""
    return (state.left == (target.prefill, target.decode) and state.left_attainment is not None
            and here_n >= cfg.calibration_min_samples and here_att <= state.left_attainment - cfg.switch_margin)


def rollback_reason(state: PlannerState, s: PlannerSignals, cfg: PlannerConfig, current: Layout, here_att: float,
              here_n: int) -> str:
    """Why to undo the last role switch (module docstring; '' not to): within ``REVISIT_WINDOWS``
    windows of it, the layout it moved to measured ``switch_margin`` less of its requests within
    their SLOs than the one it left had, under a load at most ``ROLLBACK_LOAD_TOLERANCE`` heavier
    (requests and prompt tokens per second). A heavier load (the next, document-heavier mix; a
    burst) explains a worse share without the layout. Only once the switch is seen done: the
    requests measured (``measured_from``) arrived after it."""
    if state.left is None or state.left_at is None or state.left_attainment is None or state.left_load is None:
        return ""
    if state.left == (current.prefill, current.decode) or s.at - state.left_at >= REVISIT_WINDOWS * cfg.window_s:
        return ""
    if state.settled_at is None or here_n < cfg.calibration_min_samples:
        return ""
    if here_att >= state.left_attainment - cfg.switch_margin:
        return ""
    rps, tps = s.offered_since(state.left_at)
    left_rps, left_tps = state.left_load
    if rps > left_rps * (1 + ROLLBACK_LOAD_TOLERANCE) or tps > left_tps * (1 + ROLLBACK_LOAD_TOLERANCE):
        return ""
    return (f"measured {here_att:.0%} over {here_n} requests that arrived after the switch was done "
            f"({s.at - state.settled_at:.0f} s ago, {s.at - state.left_at:.0f} s since it began), "
            f"against {state.left_attainment:.0%} before it, at {rps:.2f} req/s and {tps:.0f} prompt tokens/s "
            f"(then {left_rps:.2f} and {left_tps:.0f})")
