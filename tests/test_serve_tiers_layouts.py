"""`bench serve --compare tiers`: its layouts, run order and ratios on hand-built figures."""
from __future__ import annotations

import pytest

from bench.serve import tiers_layouts as tl


def fig(attain, p50, p99=None, goodput=1.0):
    return {"slo_attainment": attain, "goodput_rps": goodput, "ttft_p50": p50, "ttft_p99": p99 or 2 * p50,
            "cached_token_fraction": 0.5, "failed": 0}


def test_the_baseline_always_runs_first_and_unknown_layouts_are_refused():
    assert [lay.name for lay in tl.parse_layouts("on,tiers")] == ["off", "on", "tiers"]
    assert [lay.name for lay in tl.parse_layouts("on,off,on")] == ["off", "on"]
    with pytest.raises(SystemExit, match="unknown tiers layout"):
        tl.parse_layouts("off,bogus")
    assert tl.LAYOUTS["on"].tiers and tl.LAYOUTS["on"].fetch and not tl.LAYOUTS["tiers"].fetch
    assert tl.LAYOUTS["off-local"].local_uncached and tl.LAYOUTS["off-big"].device_plus_host


def test_abba_runs_each_seed_forward_then_backward():
    assert tl.schedule(["off", "on"], [1, 2], abba=True) == [
        ("off", 1), ("on", 1), ("on", 1), ("off", 1), ("off", 2), ("on", 2), ("on", 2), ("off", 2)]
    assert tl.schedule(["off", "on"], [1], abba=False) == [("off", 1), ("on", 1)]


def test_ratios_are_per_seed_against_the_same_seeds_baseline_then_averaged():
    runs = [{"layout": "off", "seed": 1, "figures": fig(0.5, 2.0)},
            {"layout": "on", "seed": 1, "figures": fig(1.0, 1.0)},
            {"layout": "on", "seed": 1, "figures": fig(1.0, 1.0)},
            {"layout": "off", "seed": 1, "figures": fig(0.5, 2.0)},
            {"layout": "off", "seed": 2, "figures": fig(0.8, 1.0)},
            {"layout": "on", "seed": 2, "figures": fig(0.8, 1.0)}]
    out = tl.compare(runs)
    on = out["layouts"]["on"]
    assert on["runs"] == 3
    assert on["slo_attainment_ratio"] == pytest.approx(1.5)  # 2.0 on seed 1, 1.0 on seed 2
    assert on["slo_attainment_ratio_range"] == [1.0, 2.0]
    assert on["ttft_p50_ratio"] == pytest.approx(1.5) and on["ttft_p99_ratio"] == pytest.approx(1.5)
    assert out["layouts"]["off"]["slo_attainment_ratio"] == pytest.approx(1.0)
    assert out["aa"] == {"seed": 1, "slo_attainment_ratio": 1.0, "goodput_rps_ratio": 1.0,
                         "ttft_p50_ratio": 1.0, "ttft_p99_ratio": 1.0}


def test_the_aa_pair_shows_the_noise_and_is_absent_without_a_repeat():
    runs = [{"layout": "off", "seed": 1, "figures": fig(0.5, 2.0)},
            {"layout": "off", "seed": 1, "figures": fig(0.4, 2.5)}]
    aa = tl.compare(runs)["aa"]
    assert aa["slo_attainment_ratio"] == pytest.approx(0.8) and aa["ttft_p50_ratio"] == pytest.approx(0.8)
    assert tl.compare(runs[:1])["aa"] is None


def test_a_layout_that_failed_every_request_has_no_ratio_rather_than_a_crash():
    dead = {**fig(0.0, 1.0), "ttft_p50": None, "ttft_p99": None, "goodput_rps": 0.0}
    runs = [{"layout": "off", "seed": 1, "figures": dead},
            {"layout": "on", "seed": 1, "figures": fig(0.5, 1.0)}]
    on = tl.compare(runs)["layouts"]["on"]
    assert on["slo_attainment_ratio"] is None and on["ttft_p50_ratio"] is None
