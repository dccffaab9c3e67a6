"""Trace replay (`pdserve bench router`) on slices of the real traces, against a real Redis, and
the simulator's parts on hand-built cases."""
from __future__ import annotations

import argparse
import io
import json
import os

import pytest

from deploy.bench import Reporter, load
from router.replay.simulator import LruCache, SimConfig, time_scale
from router.replay.traces import TraceRequest, load_trace

TRACES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "shared", "data", "traces")  # ../shared beside the repo
CONV = os.path.join(TRACES, "conversation_trace.jsonl")
AZURE = os.path.join(TRACES, "AzureLLMInferenceTrace_code.csv")
needs_traces = pytest.mark.skipif(not os.path.exists(CONV), reason="traces not present")


def test_lru_evicts_chain_tails_first_and_reports_events():
    c = LruCache(4)
    assert c.insert([1, 2, 3]) == ([3, 2, 1], [])
    assert c.match([1, 2, 3, 9]) == 3
    stored, evicted = c.insert([1, 7, 8])  # 7, 8 new; the LRU block is 3 (the older chain's tail)
    assert sorted(stored) == [7, 8] and evicted == [3]
    assert c.match([1, 2, 3]) == 2 and c.match([1, 7, 8]) == 3
    assert c.usage == 1.0


def test_time_scale_sets_the_offered_load():
    cfg = SimConfig(prefill_nodes=2, load=0.5)
    reqs = [TraceRequest(float(t), 1000, 10) for t in range(11)]  # 10 s span
    work = 11 * cfg.prefill_cost.predict(1000)
    assert time_scale(reqs, cfg) == pytest.approx(work / (2 * 0.5 * 10))


@needs_traces
def test_trace_loaders():
    conv = load_trace(CONV, 50)
    assert len(conv) == 50 and conv[0].hash_ids[0] == 0
    assert all(len(r.hash_ids) == -(-r.input_tokens // 512) for r in conv)
    az = load_trace(AZURE, 50)
    assert len(az) == 50 and az[0].arrival_s == 0.0 and not az[0].hash_ids
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(az, az[1:]))


def _run(redis_url, trace, n, policies=None):
    mod = load("router")
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    argv = ["--trace", trace, "--max-requests", str(n), "--redis-url", redis_url]
    if policies:
        argv += ["--policies", *policies]
    out = mod.run(p.parse_args(argv), Reporter(io.StringIO()))
    json.dumps(out)  # JSON-able
    return out


@needs_traces
def test_replay_conversation_slice_every_policy(redis_url):
    out = _run(redis_url, CONV, 400)
    pol = out["policies"]
    assert set(pol) >= {"pdserve", "round_robin", "least_loaded", "longest_prefix", "sglang_cache_aware",
                        "dynamo_kv", "llmd_weighted", "global_pool"}
    for name, s in pol.items():
        assert {"hit_ratio", "ttft_mean_s", "ttft_p99_s", "imbalance", "rejected", "redis_rtt_per_request"} <= set(s)
        assert s["redis_rtt_per_request"] <= 1.0
        assert s["hit_ratio"] <= out["global_pool_hit_ratio"] + 0.02, name  # the pool is an upper bound
    assert pol["pdserve"]["redis_rtt_per_request"] == 1.0
    assert pol["round_robin"]["redis_rtt_per_request"] == 0.0  # needs no index
    # prefix-aware placement finds the conversations' prefixes; round robin mostly misses them
    assert pol["pdserve"]["hit_ratio"] > 2 * pol["round_robin"]["hit_ratio"]
    assert pol["pdserve"]["index_exact_fraction"] >= 0.95


@needs_traces
def test_replay_azure_slice_matches_least_loaded(redis_url):
    out = _run(redis_url, AZURE, 400, ["pdserve", "least_loaded", "global_pool"])
    pol = out["policies"]
    assert pol["pdserve"]["hit_ratio"] == pol["least_loaded"]["hit_ratio"] == 0.0
    assert pol["pdserve"]["redis_rtt_per_request"] == 0.0  # no prefix blocks: nothing to look up
    assert pol["pdserve"]["ttft_mean_s"] <= pol["least_loaded"]["ttft_mean_s"] * 1.05
