"""`pdserve bench serve`'s pure parts: workloads, arrivals and the figures (no cluster; the live
runs are in tests/test_openai_api.py, on that module's cluster)."""
from __future__ import annotations

import random
import statistics

import pytest

from bench.serve import workload as wl
from bench.serve.metrics import Record, Slo, knee, percentile, slo_from_unloaded, summarize
from router.replay.traces import TraceRequest


def test_poisson_and_bursty_arrivals_have_the_rate_and_the_spread():
    for shape, cv in ((1.0, 1.0), (0.25, 2.0)):
        t = wl.arrivals(20000, 4.0, random.Random(0), burstiness=shape)
        gaps = [b - a for a, b in zip(t, t[1:])]
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(0.25, rel=0.05)
        assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.1)
    with pytest.raises(ValueError):
        wl.arrivals(3, 0.0, random.Random(0))


def test_mixed_workload_mixes_long_prompts_into_chat():
    reqs = wl.synthetic(400, 1.0, wl.MIXED, seed=3, shared_prefix=16)
    kinds = [r.kind for r in reqs]
    assert 0.1 < kinds.count("long") / len(kinds) < 0.3
    assert all(768 <= len(r.prompt) <= 1024 and r.max_tokens <= 16 for r in reqs if r.kind == "long")
    assert all(r.prompt[:16] == reqs[0].prompt[:16] for r in reqs)
    assert all(wl.TOKEN_LO <= t < wl.TOKEN_HI for r in reqs for t in r.prompt)
    again = wl.synthetic(400, 1.0, wl.MIXED, seed=3, shared_prefix=16)
    assert again == reqs  # a seed is a workload
    moved = wl.at_rate(reqs, 2.0)
    assert [r.prompt for r in moved] == [r.prompt for r in reqs] and moved[-1].arrival_s < reqs[-1].arrival_s


def test_trace_blocks_stay_shared_after_scaling():
    trace = [TraceRequest(10.0, 2048, 100, (1, 2, 3, 4)), TraceRequest(11.0, 1536, 50, (1, 2, 9)),
             TraceRequest(13.0, 700, 10, ())]
    reqs = wl.from_trace(trace, time_scale=2.0, max_len=1024, block_tokens=512)
    assert [r.arrival_s for r in reqs] == [0.0, 2.0, 6.0]
    assert [len(r.prompt) for r in reqs] == [1024, 768, 350]
    assert reqs[0].prompt[:512] == reqs[1].prompt[:512]  # blocks 1 and 2, 256 tokens each now
    assert reqs[0].prompt[512:768] != reqs[1].prompt[512:768]  # block 3 vs block 9
    assert [r.max_tokens for r in reqs] == [50, 25, 5]


def rec(i, sent, first, end, out, error=None):
    return Record(i, "chat", 10, out, sent, sent, first, end, out, error=error)


def test_summary_ttft_tpot_and_goodput():
    records = [rec(0, 0.0, 0.5, 1.5, 11), rec(1, 1.0, 1.2, 2.2, 6), rec(2, 2.0, 4.0, 5.0, 2),
               rec(3, 3.0, None, 3.5, 0, error="RESOURCE_EXHAUSTED")]
    s = summarize(records, Slo(ttft_s=1.0, tpot_s=0.15))
    assert s["completed"] == 3 and s["failed"] == 1 and s["duration_s"] == 5.0
    assert s["ttft_s"]["p50"] == pytest.approx(0.5)
    assert s["tpot_s"]["mean"] == pytest.approx((0.1 + 0.2 + 1.0) / 3)
    # request 0 meets both; 1 misses TPOT (0.2); 2 misses TTFT; 3 failed
    assert s["goodput_rps"] == pytest.approx(1 / 5.0) and s["slo_attainment"] == 0.25
    assert s["errors"] == ["RESOURCE_EXHAUSTED"]
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 50) is None


def test_one_slo_from_the_best_unloaded_layout_per_kind_and_the_knee():
    a = [Record(0, "chat", 10, 5, 0, 0, 0.4, 0.6, 5), Record(1, "long", 900, 5, 0, 0, 2.0, 2.2, 5)]
    b = [Record(0, "chat", 10, 5, 0, 0, 0.3, 0.7, 5), Record(1, "long", 900, 5, 0, 0, 2.5, 2.7, 5)]
    slo = slo_from_unloaded([a, b], 5, 2)
    assert dict(slo.ttft_by_kind) == {"chat": pytest.approx(1.5), "long": pytest.approx(10.0)}
    assert slo.tpot_s == pytest.approx(0.1)  # a's median TPOT 0.05 (0.05, 0.05) vs b's 0.075
    assert slo.met(Record(2, "long", 900, 5, 0, 0, 9.0, 9.2, 5))
    assert not slo.met(Record(3, "chat", 10, 5, 0, 0, 2.0, 2.2, 5))
    pts = [{"rate": 0.1, "goodput_rps": 0.1}, {"rate": 0.3, "goodput_rps": 0.25}, {"rate": 0.2, "goodput_rps": 0.25}]
    assert knee(pts)["rate"] == 0.2


def test_long_share_sets_the_mix_and_is_checked():
    for share in (0.05, 0.4):
        reqs = wl.synthetic(2000, 1.0, wl.mixed(share), seed=5)
        assert [r.kind for r in reqs].count("long") / len(reqs) == pytest.approx(share, abs=0.03)
    assert all(r.kind == "chat" for r in wl.synthetic(50, 1.0, wl.mixed(0.0), seed=5))
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="long_share"):
            wl.mixed(bad)


def test_salted_points_share_nothing_with_each_other_but_keep_their_own_sharing():
    trace = [TraceRequest(0.0, 1024, 10, (1, 2)), TraceRequest(1.0, 1024, 10, (1, 3))]
    reqs = wl.from_trace(trace, block_tokens=512)
    a, b = wl.salted(reqs, 1), wl.salted(reqs, 2)
    assert wl.salted(reqs, 0) == reqs
    assert [len(r.prompt) for r in a] == [len(r.prompt) for r in reqs]
    assert [(r.arrival_s, r.max_tokens, r.kind) for r in a] == [(r.arrival_s, r.max_tokens, r.kind) for r in reqs]
    assert a[0].prompt[:512] == a[1].prompt[:512]  # block 1 still shared inside the point
    assert a[0].prompt[512:] != a[1].prompt[512:]
    # no 16-token run of one point appears in another (the prefix cache keys on whole blocks)
    runs = {r.prompt[i:i + 16] for r in reqs for i in range(0, len(r.prompt) - 15, 16)}
    assert not runs & {r.prompt[i:i + 16] for r in a for i in range(0, len(r.prompt) - 15, 16)}
    assert a[0].prompt[:16] != b[0].prompt[:16]
    assert all(wl.TOKEN_LO <= t < wl.TOKEN_HI for r in a + b for t in r.prompt)


def test_compare_layouts_slo_grid_and_tuning_candidates():
    import argparse

    from bench.serve import run as serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    one = serve._layouts(p.parse_args(["--compare", "colocated"]))
    assert [lay.label for lay in one] == ["disagg", "colocated"]
    assert (one[0].prefill, one[0].decode, one[1].prefill, one[1].decode) == (1, 1, 0, 2)
    tune = serve._layouts(p.parse_args(["--compare", "colocated", "--disagg-local-prefill-tokens", "16,512",
                                        "--colocated-chunk-tokens", "256,512"]))
    assert [lay.label for lay in tune] == ["disagg_local16", "disagg_local512", "colocated_chunk256",
                                           "colocated_chunk512"]
    assert [lay.local_prefill_tokens for lay in tune[:2]] == [16, 512]
    assert [lay.chunk_tokens for lay in tune[2:]] == [256, 512]

    def chat(i, sent, ttft, tpot, out=11):
        return Record(i, "chat", 10, out, sent, sent, sent + ttft, sent + ttft + tpot * (out - 1), out)

    base = [[chat(0, 0, 0.1, 0.05)], [chat(0, 0, 0.1, 0.05)]]
    # disagg: TTFT 0.4 (4x unloaded), TPOT 0.06; colocated: TTFT 0.15, TPOT 0.12 (2.4x)
    runs = {"disagg": [chat(i, i, 0.4, 0.06) for i in range(4)],
            "colocated": [chat(i, i, 0.15, 0.12) for i in range(4)]}
    points = {k: [{"rate": 1.0, "_records": v}] for k, v in runs.items()}
    grid = {(g["ttft_factor"], g["tpot_factor"]): g for g in serve._slo_grid(base, points)}
    assert grid[5.0, 2.0]["goodput_ratio"] is None  # colocated misses TPOT 2x: nothing to divide by
    assert grid[5.0, 2.0]["disagg_goodput"] > 0
    assert grid[3.0, 3.0]["disagg_goodput"] == 0 and grid[3.0, 3.0]["colocated_goodput"] > 0  # TTFT 3x
    # both meet TTFT 5x and TPOT 3x: goodput is 4 requests over each run's span (first send to last end)
    assert grid[5.0, 3.0]["goodput_ratio"] == pytest.approx((3 + 0.15 + 1.2) / (3 + 0.4 + 0.6))
    assert serve._bracketed([{"rate": 1, "goodput_rps": 2}, {"rate": 2, "goodput_rps": 1}])
    assert not serve._bracketed([{"rate": 1, "goodput_rps": 1}, {"rate": 2, "goodput_rps": 2}])
