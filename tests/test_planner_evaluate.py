"""The planner's model judged on recordings (router/planner/evaluate.py,
bench/serve/elastic/model.py): pure functions over recorded rounds, and the two commands
on recordings written by the planner's own recorder."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kv_index.nodes import Role
from router.planner.config import PlannerConfig
from router.planner.decide import PlannerState, decide
from router.planner.evaluate import Ranked, Scored, current_layout, main, ranking, summarize_current, summarize_ranking
from router.planner.record import RoundRecorder, read_rounds
from router.planner.signals import PlannerSignals, RequestSample
from tests.test_planner import COLOCATED, DISAGG, signals

CFG = PlannerConfig(mode="advisory", tpot_slo_factor=3.0)


def with_latencies(s: PlannerSignals, tpot_s: float, ttft_s: float = 0.5) -> PlannerSignals:
    """``s`` with every request finished at the given TTFT and TPOT (one-token answers: no TPOT)."""
    return replace(s, requests=tuple(RequestSample(r.at, r.prompt_tokens, r.cached_tokens, r.output_tokens, ttft_s,
                                                   tpot_s if r.output_tokens > 1 else None) for r in s.requests))


HOLD = {"action": "hold"}  # a recorded decision that changed nothing


def test_current_layout_measures_only_what_ran_since_the_last_action():
    """Each round's own layout, predicted as decide calibrates it, against the share of its
    finished requests within the same targets; after an action only the requests finished since
    count, and a round with fewer than calibration_min_samples of them is not scored."""
    target = 3 * signals(0.1, 0.15).decode.step_s(1, 0)
    rounds = [(with_latencies(signals(0.1, 0.15, at=1000.0 + 5 * i, seed=i), 0.5 * target), HOLD)
              for i in range(3)]
    rows = current_layout(rounds, CFG)
    assert [r.at for r in rows] == [1000.0, 1005.0, 1010.0]
    assert all(r.mix == (1, 1) and r.measured == 1.0 and r.requests == 60 for r in rows)
    assert all(0.9 < r.predicted <= 1.0 for r in rows)  # light load: the model agrees
    # Too slow for the target: measured 0, whatever the model said.
    slow = current_layout([(with_latencies(signals(0.1, 0.15), 2 * target), HOLD)], CFG)
    assert slow[0].measured == 0.0
    # An action at round 0: round 1's window holds ~3 requests finished since (5 s at 0.6/s): unscored.
    acted = [(rounds[0][0], {"action": "switch_roles"}), *rounds[1:]]
    assert len(current_layout(acted, CFG)) == 1


def test_ranking_pairs_two_layouts_on_one_scale():
    """Documents at 40%: 1P+1D (A) measured within the TPOT target, colocated (B) past it; the
    model ranks them from either side, B's prefill fit replaced by A's (a layout without prefill
    nodes has none of its own); a pair measured alike is a tie and is left out."""
    a = with_latencies(signals(0.4, 0.6, roles=DISAGG), 0.1)
    target = 3 * a.decode.step_s(1, 0)
    b = with_latencies(replace(signals(0.4, 0.6, roles=COLOCATED), prefill=replace(a.prefill, per_token_s=1.0)),
                       2 * target)
    out = ranking([(a, b)], CFG)
    assert [r.seen_from for r in out] == ["a", "b"]
    assert all(r.measured == -1.0 for r in out)  # B met none, A all (one-token answers: by TTFT alone)
    assert out[0].predicted < 0  # from 1P+1D the model ranks it first at 40% documents
    assert ranking([(a, with_latencies(signals(0.4, 0.6, roles=COLOCATED), 0.1))], CFG) == []


def test_summaries_count_bias_error_and_reversals():
    rows = [Scored(0.0, (1, 1), 0.9, 1.0, 10), Scored(1.0, (1, 1), 0.8, 0.6, 10), Scored(2.0, (0, 2), 0.5, 0.5, 9)]
    out = summarize_current(rows)
    assert out["1P+1D"] == {"rounds": 2, "bias": pytest.approx(0.05), "mae": pytest.approx(0.15)}
    assert out["0P+2D"] == {"rounds": 1, "bias": 0.0, "mae": 0.0}
    ranked = [Ranked(-0.3, -0.1, "a"), Ranked(-0.3, 0.2, "a"), Ranked(0.2, 0.0, "a"), Ranked(0.4, 0.4, "b")]
    r = summarize_ranking(ranked)
    assert r["a"] == {"pairs": 3, "agree": 1, "b_first_a_measured_better": 1, "a_first_b_measured_better": 1,
                      "mae": pytest.approx((0.2 + 0.5 + 0.2) / 3)}
    assert r["b"]["agree"] == 1 and r["b"]["mae"] == 0.0


def _record(path, series):
    rec = RoundRecorder(str(path))
    state = PlannerState()
    for s in series:
        d = decide(s, state, replace(CFG, confirm_rounds=1))
        rec(s, d)
    rec.close()


def test_evaluate_command_reads_recordings(tmp_path, capsys):
    series = [with_latencies(signals(0.1, 0.15, at=1000.0 + 2 * i, seed=i), 0.1) for i in range(4)]
    _record(tmp_path / "r.jsonl", series)
    assert len(read_rounds(str(tmp_path / "r.jsonl"))) == 4
    assert main([str(tmp_path / "r.jsonl"), "--tpot-slo-factor", "3", "--slo-band", "0.67,1,1.33"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["1P+1D"] and out["1P+1D"]["rounds"] >= 1 and 0 <= out["1P+1D"]["mae"] <= 1


def test_elastic_model_command_pairs_rounds_by_offset_into_each_stream(tmp_path, capsys):
    """bench/serve/elastic/model.py: the fixed and colocated passes' rounds at the same
    offset into the same stream are paired, whatever their wall clocks."""
    from bench.serve.elastic.model import by_offset, pairs
    from bench.serve.elastic.model import main as bench_main

    starts = []
    for lay, roles, t0, tpot in (("fixed", DISAGG, 1000.0, 0.1), ("colocated", COLOCATED, 5000.0, 0.5)):
        starts.append({"layout": lay, "pass": 1, "stream": "phases", "wall_start": t0})
        _record(tmp_path / f"p_{lay}_pass1.jsonl",
                [with_latencies(signals(0.4, 0.6, roles=roles, at=t0 + 2 * i + 0.3, seed=i), tpot) for i in range(3)])
    keyed = by_offset([s for s, _ in read_rounds(str(tmp_path / "p_fixed_pass1.jsonl"))], [(1000.0, "phases")])
    assert sorted(keyed) == [("phases", 0), ("phases", 1), ("phases", 2)]
    result = {"stream_starts": starts}
    got = pairs(result, str(tmp_path / "p"))
    assert [(round(a.at - 1000.0, 6), round(b.at - 5000.0, 6)) for a, b in got] == [(0.3, 0.3), (2.3, 2.3), (4.3, 4.3)]
    assert [(a.count(Role.PREFILL), b.count(Role.PREFILL)) for a, b in got] == [(1, 0)] * 3
    (tmp_path / "result.json").write_text(json.dumps(result) + "\n")
    assert bench_main([str(tmp_path / "result.json"), str(tmp_path / "p")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["current_layout"]) == {"fixed", "colocated"}
    assert out["ranking"]["a"]["pairs"] == 3 and out["ranking"]["b"]["pairs"] == 3
