"""`pdserve bench` plumbing: the last line printed with --json is one JSON object."""
from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO, run_bench


def test_kv_memory_bench_reports_paged_vs_contiguous():
    out = run_bench("kv-memory", "--max-requests", "60")
    assert set(out["per_trace"]) == {"azure-code", "azure-conv", "mooncake-conv"}
    assert 0.0 <= out["paged_waste"] < out["contiguous_waste"] <= 1.0
    assert out["concurrency_ratio"] >= 1.0
    assert out["per_trace"]["azure-conv"]["concurrency_ratio"] > 1.0


def test_unknown_bench_is_refused():
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "nope"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "known:" in r.stderr


def test_verify_cost_bench_reports_a_ratio_per_batch_and_k():
    out = run_bench("verify-cost", "--device", "cpu", "--batches", "1,2", "--ks", "1,3", "--context", "24",
                    "--repeats", "1")
    assert out["device"] == "cpu" and out["backend"] == "TorchRefBackend"
    assert [(c["batch"], c["k"]) for c in out["cells"]] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(c["ms"] > 0 and c["decode_ms"] > 0 and abs(c["ratio"] - c["ms"] / c["decode_ms"]) < 0.01
               for c in out["cells"])


def test_kv_tiers_bench_reports_each_tier_against_its_baseline(tmp_path):
    out = run_bench("kv-tiers", "--blocks", "8", "--repeats", "1", "--dir", str(tmp_path))
    assert out["bit_exact"] is True and out["blocks"] == 8 and out["block_bytes"] == 737280
    for tier in ("host", "disk"):
        t = out["tiers"][tier]
        assert t["offload_gbps"] > 0 and t["onboard_gbps"] > 0
        assert t["ratio"] == min(t["offload_ratio"], t["onboard_ratio"])


def test_a_failed_check_fails_the_command_a_missed_target_does_not():
    from deploy.cli import failed_checks

    assert failed_checks({"passed": False, "bit_exact": True}) == ["passed"]
    assert failed_checks({"bit_exact": False}) == ["bit_exact"]
    assert failed_checks({"passed": True, "met": False, "ratio": 0.2}) == []  # a figure, not a verdict
    assert failed_checks({}) == []
