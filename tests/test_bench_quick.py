"""The quick mode of each issue-15 benchmark runs end to end on tiny random models, and its
--json line carries the fields scripts read (docs/benchmarks.md)."""
from __future__ import annotations

import pytest

from tests.helpers import run_bench

# The benches run with one torch thread (--threads 1): on a shared 2-core machine two threads
# wait on each other's barriers.


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_bench_quick_reports_both_transformers_baselines(dtype):
    out = run_bench("engine", "--quick", "--threads", "1", "--dtype", dtype)
    assert out["dtype"] == dtype and out["model"] == "tiny-llama"
    assert out["requests"] == 8 and out["output_tokens"] > 0
    for key in ("speedup_vs_generate_batch", "speedup_vs_hf", "engine_tok_s", "generate_batch_tok_s", "hf_tok_s"):
        assert out[key] > 0, key
    # A B A: the engine runs before and after the baselines; the ratio uses their mean.
    assert len(out["engine_s_runs"]) == 2
    assert out["engine_s"] == pytest.approx(sum(out["engine_s_runs"]) / 2, abs=1e-3)  # runs rounded to ms
    low, high = out["speedup_vs_hf_range"]
    assert low <= out["speedup_vs_hf"] * 1.001 and out["speedup_vs_hf"] <= high * 1.001


def test_exactness_bench_quick_is_identical_in_float32_and_explains_bf16():
    out = run_bench("exactness", "--quick", "--threads", "1")
    assert out["dtype"] == "float32" and out["max_tokens"] == 16
    assert out["prompts"] == 17 and out["identical"] == out["prompts"]
    bf16 = out["bf16"]
    assert bf16["prompts"] == 17 and 0 <= bf16["identical"] <= 17
    assert bf16["divergences"] == 17 - bf16["identical"]
    assert 0 <= bf16["near_tie_divergences"] <= bf16["divergences"]
    for dv in bf16["per_model"][0]["divergences"]:
        assert 0 <= dv["position"] < 16 and isinstance(dv["engine_alone_identical"], bool)


def test_specdec_bench_quick_has_natural_forced_and_peer_rows():
    out = run_bench("specdec", "--quick", "--threads", "1")
    assert out["stopping"].startswith("natural") and out["proposer"] == "ngram"
    for key in ("speedup", "speedup_open", "speedup_forced_length", "hf_prompt_lookup_speedup"):
        assert out[key] > 0, key
    assert out["outputs_identical"] and out["hf_outputs_identical"]
    assert out["per_proposer_forced_length"]["off"]["grounded"]["tokens"] == 2 * 16  # forced: exact length


def test_specdec_bench_repeats_each_chunk_and_reports_every_repeat():
    out = run_bench("specdec", "--quick", "--threads", "1", "--repeats", "2", "--skip-hf", "--skip-forced")
    assert out["repeats"] == 2
    assert len(out["speedup_repeats"]) == 2 and len(out["speedup_open_repeats"]) == 2
    assert all(x > 0 for x in out["speedup_repeats"] + out["speedup_open_repeats"])
    # Tokens add up over the repeats; the mean output length is per prompt, not per repeat.
    off = out["per_proposer"]["off"]["grounded"]
    assert off["tokens"] == 2 * 2 * out["mean_output_tokens"]["grounded"]
    assert out["outputs_identical"]  # and every repeat returned the first one's tokens (else it raises)


def test_kv_memory_bench_reports_the_mean_and_the_max_tokens_reservation():
    out = run_bench("kv-memory", "--max-requests", "300")  # enough for a backlog on every trace
    assert out["concurrency_ratio_mean"] == out["saturated_concurrency_ratio"] > 0
    # Reserving exactly prompt + output is the strongest contiguous baseline: paging beats the
    # max_model_len reservation by far more than it beats this one.
    assert 0 < out["concurrency_ratio_vs_reserve_max_tokens"] <= out["concurrency_ratio"]
    for r in out["per_trace"].values():
        assert r["reserve_peak_concurrency"] >= r["contiguous_peak_concurrency"]
        assert r["reserve_waste"] < r["contiguous_waste"]


def test_structured_bench_quick_reports_its_fields():
    out = run_bench("structured", "--quick", "--threads", "1")
    for key in ("overhead_batch1", "overhead_batch8"):
        assert isinstance(out[key], float), key
    assert out["valid"] == out["requests"] == 4 and out["engine"] == "llguidance"
    assert 0 < out["compile_ms_p50"] <= out["compile_ms_p99"] and out["compiles"] >= 20
