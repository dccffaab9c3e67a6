"""The planner's model judged against what the layouts measured, offline, on recordings
(router/planner/record.py).

Two questions, each a pure function of recorded rounds:

- ``current_layout``: how far the model's attainment for the layout a round ran on (calibrated
  as ``decide`` calibrates it) is from the share of the window's finished requests that met the
  same targets (``model.measured_share``), round by round. The planner's own layout is the one
  it can check; an error here is an error it cannot see in the others.
- ``ranking``: two recordings of the same requests served by two role mixes (the elastic
  benchmark's fixed and colocated passes), paired round by round: did the model running on one
  of them rank the two as they measured? The planner decides on the difference, not on either
  figure, and a model that ranks from one layout and not from the other locks the planner in
  (docs/placement.md, "What the planner does not know").

    python -m router.planner.evaluate RECORDING.jsonl [...]

prints the first per role mix; ``bench/serve/elastic/model.py`` pairs a benchmark's
recordings for the second.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from router.planner.config import PlannerConfig
from router.planner.decide import calibration, thresholds
from router.planner.decide import current_layout as layout_of
from router.planner.model import Calibration, Layout, estimate, measured_share
from router.planner.record import read_rounds
from router.planner.returns import PlannerState, measured_from, seen_settled
from router.planner.signals import PlannerSignals


@dataclass(frozen=True, slots=True)
class Scored:
    """One round: the current layout's predicted and measured attainment."""

    at: float
    mix: tuple[int, int]  # (prefill, decode) nodes
    predicted: float
    measured: float
    requests: int  # finished requests measured


@dataclass(frozen=True, slots=True)
class Ranked:
    """One pair of rounds: layout B's attainment minus layout A's, measured and predicted."""

    measured: float
    predicted: float
    seen_from: str  # "a" or "b": the layout whose planner predicted


def _share(s: PlannerSignals, cfg: PlannerConfig, since: float | None = None,
           arrived: float | None = None) -> tuple[float, int]:
    return measured_share(s, cfg.ttft_slo_factor, cfg.tpot_slo_factor, since=since, band=cfg.slo_band,
                          arrived_since=arrived)


def current_layout(rounds: Iterable[tuple[PlannerSignals, dict]], cfg: PlannerConfig) -> list[Scored]:
    """Per round that measured ``calibration_min_samples`` finished requests since the recording's last
    action (its decisions say when; before it the window ran another layout), after a role
    switch only those that arrived after it was done, as ``decide`` measures them."""
    out, state = [], PlannerState()
    for s, decision in rounds:
        cur = layout_of(s)
        state = seen_settled(state, s, cur)
        since, arrived = measured_from(state)
        if not s.draining and cur.decode >= 1 and len(s.requests) >= cfg.min_requests:
            measured, n = _share(s, cfg, since, arrived)
            if n >= cfg.calibration_min_samples:
                e = estimate(cur, s, cfg.ttft_slo_factor, cfg.tpot_slo_factor, calibration(s, cfg, since, arrived),
                             cfg.slo_band)
                out.append(Scored(s.at, (cur.prefill, cur.decode), e.attainment, measured, n))
        action = decision.get("action", "hold")
        if action == "switch_roles":
            state = PlannerState(last_action_at=s.at, left=(cur.prefill, cur.decode), left_at=s.at)
        elif action != "hold":
            state = PlannerState(last_action_at=s.at)
    return out


def predicted_mix(s: PlannerSignals, mix: tuple[int, int], cfg: PlannerConfig, cal: Calibration) -> float:
    """The model's attainment for a role mix on round ``s``: with prefill nodes, at its best
    threshold (the planner sets it with the mix)."""
    p, d = mix
    ts = thresholds(cfg, s.short_prompt_tokens) if p else [s.short_prompt_tokens]
    return max(estimate(Layout(p, d, t), s, cfg.ttft_slo_factor, cfg.tpot_slo_factor, cal, cfg.slo_band).attainment
               for t in ts)


def ranking(pairs: Iterable[tuple[PlannerSignals, PlannerSignals]], cfg: PlannerConfig,
            min_gap: float = 0.1) -> list[Ranked]:
    """``pairs``: rounds of the same requests at the same offset, on role mixes A and B (static
    layouts: no action in either). Each layout's measured share is judged by A's fitted costs
    (one scale: the targets depend on the prefill fit, which a layout without prefill nodes
    lacks); B's planner predicts with A's prefill and transfer fits for the same reason. Pairs
    measured within ``min_gap`` of each other are ties: nothing to rank."""
    out = []
    for a, b in pairs:
        b = replace(b, prefill=a.prefill, transfer_fixed_s=a.transfer_fixed_s,
                    transfer_s_per_token=a.transfer_s_per_token)
        ma, na = _share(a, cfg)
        mb, nb = _share(replace(b, decode=a.decode, unloaded_tpot_s=a.unloaded_tpot_s), cfg)
        if min(na, nb) < cfg.calibration_min_samples or abs(mb - ma) < min_gap:
            continue
        mix_a, mix_b = (layout_of(a).prefill, layout_of(a).decode), (layout_of(b).prefill, layout_of(b).decode)
        for name, s in (("a", a), ("b", b)):
            if len(s.requests) < cfg.min_requests:
                continue
            cal = calibration(s, cfg, None)
            out.append(Ranked(mb - ma, predicted_mix(s, mix_b, cfg, cal) - predicted_mix(s, mix_a, cfg, cal), name))
    return out


def summarize_current(rows: Sequence[Scored]) -> dict[str, dict]:
    """Per role mix ("1P+1D", "0P+2D"): rounds, bias (predicted - measured) and mean absolute error."""
    by: dict[str, list[Scored]] = {}
    for r in rows:
        by.setdefault(f"{r.mix[0]}P+{r.mix[1]}D", []).append(r)
    return {k: {"rounds": len(v), "bias": sum(r.predicted - r.measured for r in v) / len(v),
                "mae": sum(abs(r.predicted - r.measured) for r in v) / len(v)} for k, v in sorted(by.items())}


def summarize_ranking(rows: Sequence[Ranked]) -> dict[str, dict]:
    """Per side that predicted: pairs, how many the model ranked as measured, how many it ranked
    B first when A measured better (and the reverse), and the mean error of the difference."""
    out = {}
    for side in ("a", "b"):
        v = [r for r in rows if r.seen_from == side]
        if not v:
            continue
        out[side] = {"pairs": len(v), "agree": sum((r.measured > 0) == (r.predicted > 0) for r in v),
                     "b_first_a_measured_better": sum(r.measured < 0 < r.predicted for r in v),
                     "a_first_b_measured_better": sum(r.predicted <= 0 < r.measured for r in v),
                     "mae": sum(abs(r.measured - r.predicted) for r in v) / len(v)}
    return out


def config_from(args: argparse.Namespace) -> PlannerConfig:
    return PlannerConfig(mode="advisory", ttft_slo_factor=args.ttft_slo_factor, tpot_slo_factor=args.tpot_slo_factor,
                         slo_band=tuple(args.slo_band))


def add_model_args(p: argparse.ArgumentParser) -> None:
    from router.planner.config import slo_band

    p.add_argument("--ttft-slo-factor", type=float, default=5.0)
    p.add_argument("--tpot-slo-factor", type=float, default=3.0, help="the elastic benchmark's planner's (default 3)")
    p.add_argument("--slo-band", type=slo_band, default=(1.0,), help="e.g. 0.67,1,1.33 (default: the SLO alone)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m router.planner.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("recordings", nargs="+", help="planner recordings (--planner-record files)")
    add_model_args(p)
    args = p.parse_args(argv)
    cfg = config_from(args)
    rows = [r for path in args.recordings for r in current_layout(read_rounds(path), cfg)]
    json.dump(summarize_current(rows), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
