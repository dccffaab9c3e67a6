"""`pdserve bench engine --baselines vllm` (bench/vllm_baseline.py, bench/vllm_peer.py): the
pure parts (modes, the thread and KV environment vLLM gets, the greedy comparison) without vLLM;
then, where vLLM's own Python is found ($PDSERVE_VLLM_PYTHON, .venv-vllm from `make vllm`), a
short live run on the builtin model: lengths checked on both sides, float32 greedy ids identical,
the ratios and batch-1 figures reported. Without vLLM the live test skips, saying why (CI has no
vLLM environment: installing it costs about 3 minutes of the 20)."""
from __future__ import annotations

import os

import pytest

from bench.vllm_baseline import compare_greedy, parse_modes, thread_env
from node.vllm_engine import vllm_python
from tests.helpers import run_bench


def test_modes_are_checked():
    assert parse_modes("eager, compiled") == ["eager", "compiled"]
    for bad in ("", "fast", "eager,jit"):
        with pytest.raises(SystemExit, match="--vllm-modes"):
            parse_modes(bad)


def test_vllm_gets_the_engines_threads_on_the_first_cores_and_no_reserved_core():
    env = thread_env(2, 1 << 30, cores=[3, 1, 2])
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1,2"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert thread_env(1, 100 << 20, cores=[0])["VLLM_CPU_KVCACHE_SPACE"] == "1"  # its unit is GiB, at least 1


def test_greedy_comparison_names_where_the_decodes_part():
    got = compare_greedy([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [7, 8, 9]])
    assert got == {"identical": 1, "prompts": 3, "first_divergence": [None, 1, 2]}


def _vllm():
    try:
        return vllm_python()
    except FileNotFoundError:
        return None


@pytest.mark.skipif(_vllm() is None, reason="no vLLM Python ($PDSERVE_VLLM_PYTHON or `make vllm`)")
def test_vllm_runs_beside_the_engine_on_the_same_requests():
    out = run_bench("engine", "--requests", "4", "--prompt-len", "16,32", "--output-len", "4,8", "--batch", "4",
                    "--baselines", "vllm", "--vllm-modes", "eager", "--dtype", "float32", "--batch1-tokens", "16",
                    timeout=900)
    assert out["greedy_identical_required"] and out["greedy_ok"], out["greedy_check"]
    assert out["greedy_check"]["eager"]["identical"] == 4
    assert out["speedup_vs_vllm"] == out["speedup_vs_vllm_eager"] > 0
    lo, hi = out["speedup_vs_vllm_range"]
    assert lo <= out["speedup_vs_vllm"] <= hi
    assert out["batch1_decode_tokens_per_s"]["engine"] > 0 and out["batch1_decode_tokens_per_s"]["vllm_eager"] > 0
    assert os.path.exists(_vllm())
