"""The registered matmul curve (kv_index/matmul_curve.py) and the decode cost built on it
(router/cost_model.py DecodeCost): pure functions, no model, no socket."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from kv_index.matmul_curve import curve_s, format_curve, parse_curve
from router.cost_model import DecodeCost

# SmolLM2-135M's matmuls per decode step by batch rows (ms), float32, one thread, from the
# kernel plan the engine tuned on the 2-core Xeon dev VM (2026-12-03): the jump at 4 rows is
# the BLAS kernels changing path.
PLAN = ((1, 40.6), (2, 41.5), (3, 43.4), (4, 63.6), (5, 67.2), (6, 68.5), (7, 69.0), (8, 70.0),
        (10, 73.9), (12, 78.9), (16, 83.2), (24, 94.9))


def test_round_trip_and_malformed_text():
    assert parse_curve(format_curve(PLAN)) == PLAN
    assert parse_curve("") == ()
    for bad in ("1:2,2", "a:1", "2:1,1:1", "1:1,1:2", "0:1", "1:-3", "1:nan"):
        assert parse_curve(bad) == (), bad


def test_interpolation_between_and_beyond_the_rows():
    assert curve_s((), 8) == 0.0
    assert curve_s(PLAN, 4) == pytest.approx(0.0636)
    assert curve_s(PLAN, 3.5) == pytest.approx((43.4 + 63.6) / 2e3)
    assert curve_s(PLAN, 0.5) == pytest.approx(0.0406)  # below the first row: its value
    assert curve_s(PLAN, 32) == pytest.approx((94.9 + (94.9 - 83.2)) / 1e3)  # the last segment's line


def test_the_secant_meets_the_curve_at_batch_one_and_at_its_batch():
    d = DecodeCost(0.012, 0.0044, 2e-8, PLAN)
    for b in (1.0, 2.0, 3.5, 4.0, 9.0, 20.0, 40.0):
        line = d.secant(b)
        assert line.matmul == ()
        for batch in (1.0, b):
            assert line.step_s(batch, 300 * batch) == pytest.approx(d.step_s(batch, 300 * batch)), (b, batch)
    assert d.base_s == pytest.approx(0.012 + 0.0406)
    plain = DecodeCost(0.012, 0.0044, 2e-8)
    assert plain.secant(8) is plain and plain.base_s == 0.012


def test_a_recorded_cost_reads_back_with_its_curve():
    d = DecodeCost(0.012, 0.0044, 2e-8, PLAN)
    back = DecodeCost(**json.loads(json.dumps(asdict(d))))  # router/planner/record.py's path
    assert back == d and hash(back) == hash(d)


# Whole decode steps measured on the same VM (ms; an engine at batch B, 300 tokens of context
# per sequence, one pinned core): the matmuls' jump at 4 rows shows, and more.
MEASURED = {1: 53.4, 2: 62.0, 3: 68.6, 4: 98.3, 5: 104.3, 6: 103.4, 8: 113.9, 16: 161.9}
CTX = 300


def _fit(batches, curve):
    from kv_index.nodes import NodeInfo
    from router.planner.decode_fit import DecodeFit

    fit = DecodeFit()
    for i in range(40):
        b = batches[i % len(batches)]
        fit.observe([NodeInfo("d", "decode", "a:1", "fp", 16, 64, matmul_ms=curve, running=b,
                              running_tokens=b * CTX, step_s=1.0, decode_step_s=MEASURED[b] / 1e3,
                              decode_step_running=b, decode_step_tokens=b * CTX, updated_at=float(i))],
                    unloaded_tpot_s=MEASURED[1] / 1e3)
    return fit.model


def test_a_fit_on_small_batches_predicts_the_large_ones_with_the_curve():
    """A colocated node runs batches 2-6, a disaggregated decode node 6-16: a line through the
    first priced a sequence ~10 ms and predicted the second's steps far too slow (the elastic
    benchmark's planner misranked 1P+1D from the colocated layout); the line through what the
    matmuls leave carries over."""
    small = [2, 3, 4, 5, 6]
    with_curve, line = _fit(small, PLAN), _fit(small, ())
    for b in (8, 16):
        measured = MEASURED[b] / 1e3
        assert with_curve.step_s(b, b * CTX) == pytest.approx(measured, rel=0.12), b
        assert line.step_s(b, b * CTX) > 1.15 * measured, b  # the line alone overshoots
    big = _fit([6, 8, 16], PLAN)  # and from the large batches, the small ones
    assert big.step_s(3, 3 * CTX) == pytest.approx(MEASURED[3] / 1e3, rel=0.12)
    assert with_curve.matmul == PLAN


def test_the_estimate_runs_the_curve_at_its_own_operating_batch():
    """``estimate``'s TPOT is the step at the batch it implies (Little: B = a tpot), on the curve."""
    from router.planner.model import Calibration, Layout, estimate, operating_cost
    from router.planner.signals import PlannerSignals, RequestSample

    d = DecodeCost(0.0128, 0.0044, 0.0, PLAN)
    reqs = tuple(RequestSample(float(i), 40, 0, 120, None, None) for i in range(40))
    for rate in (0.2, 0.5, 1.0):
        s = PlannerSignals(at=40.0, span_s=40 / rate, nodes=(), requests=reqs, decode=d)
        e = estimate(Layout(1, 1, 0), s)  # every prompt prefilled remotely: decode alone
        batch = rate * 120 * e.tpot_s
        assert batch > 1 and e.tpot_s == pytest.approx(d.step_s(batch, 0), rel=1e-3), rate
        line = operating_cost(d, rate * 120, 0.0, 0.0, Calibration())
        assert line.step_s(batch, 0) == pytest.approx(d.step_s(batch, 0), rel=1e-3)
    # Past saturation the layout predicts nothing met (the line at the search's end).
    s = PlannerSignals(at=40.0, span_s=1.0, nodes=(), requests=reqs, decode=d)
    assert estimate(Layout(1, 1, 0), s).attainment == 0.0
