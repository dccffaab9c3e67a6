"""Trace replay (`pdserve bench router`) on slices of the real traces, against a real Redis, and
the simulator's parts on hand-built cases."""
from __future__ import annotations

import argparse
import io
import json
import math
import os

import pytest

from bench import Reporter, benchmark_module
from bench.router_tuning import KNOBS
from router.cost_model import CostBook, PrefillCost
from router.node_view import PrefillLedger
from router.placement import Placement, PlacementPolicy, TtftPolicy
from router.replay.baselines import RoundRobin
from router.replay.simulator import LruCache, NodeTruth, SimConfig, simulate, time_scale
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
    work = 11 * cfg.truth.seconds(1000)
    assert time_scale(reqs, cfg) == pytest.approx(work / (2 * 0.5 * 10))


def test_node_truth_is_not_the_routers_prior():
    truth, prior = NodeTruth(), PrefillCost()
    assert truth.seconds(100) == pytest.approx(truth.seconds(512), rel=0.01)  # a floor the fitted family lacks
    assert truth.seconds(7000) < 0.85 * prior.predict(7000)
    assert truth.seconds(85000) > 1.05 * prior.predict(85000)
    cfg = SimConfig(prefill_nodes=8, speed_spread=0.4)
    assert cfg.speed(0) == pytest.approx(0.8) and cfg.speed(7) == pytest.approx(1.2)


class Recorder(PlacementPolicy):
    """Sends every request to prefill-0 and records what the router saw when it chose."""

    uses_index = False

    def __init__(self, costs: CostBook, probe=lambda: None) -> None:
        self.inner = TtftPolicy(costs, short_prompt_tokens=0)
        self.probe = probe
        self.seen: list[tuple] = []

    def choose(self, request, nodes, matched_blocks, backlog_s=None) -> Placement:
        self.seen.append(({n.node_id: n for n in nodes}, dict(backlog_s), self.probe()))
        only = [n for n in nodes if n.node_id == "prefill-0" or n.role == "decode"]
        return self.inner.choose(request, only, matched_blocks, backlog_s)


def test_simulated_router_sees_the_live_ledger_and_heartbeats():
    """Three 20k-token prompts 1 ms apart on one node: at the third arrival the first is
    running and the second waiting. The heartbeat counts each once (the running one's tokens,
    one waiting request); the queue view is the live ledger's, the predicted prefill seconds
    of both in full: nothing is taken off for the time the running one has had."""
    cfg = SimConfig(prefill_nodes=2, decode_nodes=1, speed_spread=0.0, step_noise=0.0)
    reqs = [TraceRequest(i * 0.001, 20_000, 10) for i in range(3)]
    costs = CostBook()
    pol = Recorder(costs)
    res = simulate("rec", reqs, cfg, pol, costs, None, admission="none", scale=1.0)
    assert res.rejected == 0 and all(not math.isnan(x) for x in res.ttft_s)
    nodes, backlog, _ = pol.seen[2]
    p0 = nodes["prefill-0"]
    assert (p0.running, p0.waiting, p0.running_tokens) == (1, 1, 20_000)
    assert p0.kv_usage == pytest.approx(-(-20_000 // cfg.block_size) / (cfg.cache_tokens // cfg.block_size))
    predicted = costs.prior.predict(20_000)  # no step report has arrived yet: the prior
    live = PrefillLedger()
    live.add("prefill-0", "0", predicted)
    live.add("prefill-0", "1", predicted)
    assert live.backlog_s() == pytest.approx({"prefill-0": 2 * predicted})
    assert backlog == pytest.approx(live.backlog_s())
    assert "decode-0" not in backlog  # the live ledger has no decode backlog


def test_step_reports_reach_the_cost_book_only_after_the_prefill_and_a_refresh():
    cfg = SimConfig(prefill_nodes=1, decode_nodes=1, speed_spread=0.0, step_noise=0.0, report_delay_s=0.5)
    first = cfg.truth.seconds(8000)
    reqs = [TraceRequest(0.0, 8000, 10), TraceRequest(first + 0.25, 8000, 10), TraceRequest(first + 0.75, 8000, 10)]

    class Book(CostBook):
        def __init__(self) -> None:
            super().__init__()
            self.reports = []

        def add_step(self, node_id, report) -> None:
            self.reports.append(report)
            super().add_step(node_id, report)

    costs = Book()
    pol = Recorder(costs, probe=lambda: len(costs.reports))
    simulate("rec", reqs, cfg, pol, costs, None, admission="none", scale=1.0)
    assert [probe for _, _, probe in pol.seen] == [0, 0, 1]  # done at `first`, known at first + 0.5
    assert costs.reports[0].seconds == pytest.approx(first) and costs.reports[0].new_tokens == 8000


def test_the_cost_book_learns_each_nodes_speed_from_a_generic_prior():
    cfg = SimConfig(prefill_nodes=4, decode_nodes=1, speed_spread=0.6, step_noise=0.1)
    reqs = [TraceRequest(i * 0.5, 2000 + (i * 7919) % 30000, 10) for i in range(600)]
    costs = CostBook()
    simulate("rr", reqs, cfg, RoundRobin(), costs, None, admission="none")
    for i in range(4):
        truth = cfg.truth.seconds(16000) * cfg.speed(i)
        assert costs.prefill(f"prefill-{i}").predict(16000) == pytest.approx(truth, rel=0.05)
    assert costs.prior.predict(16000) != pytest.approx(cfg.truth.seconds(16000), rel=0.05)


def test_one_admission_gate_for_every_policy_and_rejections_are_misses():
    cfg = SimConfig(prefill_nodes=2, decode_nodes=1, load=3.0, step_noise=0.0)  # overloaded
    reqs = [TraceRequest(i * 0.1, 6000, 10) for i in range(200)]
    gated = simulate("rr", reqs, cfg, RoundRobin(), CostBook(), None, admission="pdserve_model")
    open_ = simulate("rr", reqs, cfg, RoundRobin(), CostBook(), None, admission="none")
    assert gated.rejected > 0 and open_.rejected == 0
    assert sum(math.isnan(x) for x in gated.ttft_s) == gated.rejected and len(gated.ttft_s) == 200
    for r in (gated, open_):
        s = r.summary()
        assert s["goodput_rps"] == pytest.approx(r.ttft_met / r.span_s)
        assert r.slo_met <= r.ttft_met <= r.requests - r.rejected
    assert gated.ttft_met > open_.ttft_met  # shedding what would miss keeps the queue short for the rest


def test_summary_over_a_common_set_of_requests():
    cfg = SimConfig(prefill_nodes=2, decode_nodes=1, load=3.0, step_noise=0.0)
    reqs = [TraceRequest(i * 0.1, 6000, 10) for i in range(100)]
    r = simulate("rr", reqs, cfg, RoundRobin(), CostBook(), None, admission="pdserve_model")
    served = [not math.isnan(x) for x in r.ttft_s]
    first_ten = [i < 10 for i in range(100)]
    s = r.summary([a and b for a, b in zip(served, first_ten)])
    assert s["ttft_requests"] == sum(served[:10])
    assert s["ttft_mean_s"] == pytest.approx(sum(x for x in r.ttft_s[:10] if not math.isnan(x)) / sum(served[:10]))


@needs_traces
def test_trace_loaders():
    conv = load_trace(CONV, 50)
    assert len(conv) == 50 and conv[0].hash_ids[0] == 0
    assert all(len(r.hash_ids) == -(-r.input_tokens // 512) for r in conv)
    az = load_trace(AZURE, 50)
    assert len(az) == 50 and az[0].arrival_s == 0.0 and not az[0].hash_ids
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(az, az[1:]))


def _run(redis_url, trace, n, *extra):
    mod = benchmark_module("router")
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    argv = ["--trace", trace, "--max-requests", str(n), "--redis-url", redis_url, *extra]
    out = mod.run(p.parse_args(argv), Reporter(io.StringIO()))
    json.dumps(out)  # JSON-able
    return out


def _table(out, mode="none", seed=0):
    """One admission mode's, one seed's comparison."""
    return out["per_seed"][mode][str(seed)]


@needs_traces
def test_replay_conversation_slice_every_policy(redis_url):
    out = _run(redis_url, CONV, 400, "--seeds", "0", "--admission", "queue_bound")
    assert out["admission"] == ["queue_bound"] and out["tuned_on"] == "conversation_trace.jsonl:tune"
    assert out["seeds"] == [0] and out["seed_role"] == "development"
    one = _table(out, "queue_bound")
    pol = one["policies"]
    assert set(pol) >= {"pdserve", "round_robin", "least_loaded", "longest_prefix", "sglang_cache_aware",
                        "dynamo_kv", "llmd_weighted", "global_pool", "dynamo_kv+fetch"}
    for name, s in pol.items():
        assert {"hit_ratio", "goodput_rps", "ttft_mean_s", "ttft_p99_s", "imbalance", "rejected",
                "redis_rtt_per_request"} <= set(s)
        assert s["redis_rtt_per_request"] <= 1.0
        assert s["ttft_requests"] == one["ttft_requests"]  # TTFT statistics over the same requests
        assert s["hit_ratio"] <= one["global_pool_hit_ratio"] + 0.02, name  # the pool is an upper bound
    assert pol["pdserve"]["redis_rtt_per_request"] == 1.0
    for own_tree in ("round_robin", "sglang_cache_aware", "llmd_weighted"):  # no KV-event index
        assert pol[own_tree]["redis_rtt_per_request"] == 0.0
    # prefix-aware placement finds the conversations' prefixes; round robin mostly misses them
    assert pol["pdserve"]["hit_ratio"] > 2 * pol["round_robin"]["hit_ratio"]
    assert pol["pdserve"]["index_exact_fraction"] >= 0.95
    assert pol["pdserve"]["constant"] == benchmark_module("router").constants("pdserve")
    # the shared tier: the peer fetches, and the same peer without it does not
    assert pol["dynamo_kv+fetch"]["fetched_tokens"] > 0 == pol["dynamo_kv"]["fetched_tokens"]
    gated = out["gated"]
    assert "headline" not in out and gated["admission"] == "queue_bound"
    assert gated["policies"]["pdserve"]["goodput_rps"]["mean"] == pol["pdserve"]["goodput_rps"]
    assert gated["capability_result"]["ratios"]["dynamo_kv"]["against"] == "dynamo_kv+fetch"
    assert out["all_interior"] and out["tuning_check"]["dynamo_kv"]["knobs"]["overlap_weight"]["position"] == "interior"


@needs_traces
def test_replay_without_admission_serves_everything(redis_url):
    out = _run(redis_url, AZURE, 400, "--policies", "pdserve", "least_loaded", "global_pool", "--admission", "none",
               "--seeds", "0,7")
    assert out["admission"] == ["none"] and out["seeds"] == [0, 7]
    for seed in (0, 7):
        one = _table(out, seed=seed)
        pol = one["policies"]
        assert one["ttft_requests"] == 400
        assert all(s["rejected"] == 0 for s in pol.values())
        assert pol["pdserve"]["hit_ratio"] == pol["least_loaded"]["hit_ratio"] == 0.0
        assert pol["pdserve"]["redis_rtt_per_request"] == 0.0  # no prefix blocks: nothing to look up
    head = out["headline"]["policies"]["pdserve"]["goodput_rps"]
    assert head["n"] == 2 and head["lo"] <= head["mean"] <= head["hi"]


@needs_traces
def test_splits_and_tuning(redis_url):
    tune = _run(redis_url, CONV, 200, "--split", "tune", "--policies", "pdserve", "round_robin", "--seeds", "0",
                "--admission", "none")
    hold = _run(redis_url, CONV, 200, "--split", "holdout", "--policies", "pdserve", "--seeds", "0",
                "--admission", "none")
    assert (tune["requests"], hold["requests"], tune["split"]) == (100, 100, "tune")
    swept = _run(redis_url, CONV, 200, "--split", "tune", "--tune", "--policies", "pdserve", "round_robin",
                 "--seeds", "0", "--admission", "none")
    assert set(swept["chosen"]) == {"pdserve"}  # round robin has nothing to tune
    runs = swept["tuning"]["pdserve"]
    grid = list(KNOBS["pdserve"]["compute_weight"].grid)
    assert [r["constants"]["compute_weight"] for r in runs] == grid
    assert swept["chosen"]["pdserve"] in [r["constants"] for r in runs]
    assert swept["tuning_check"]["pdserve"]["knobs"]["compute_weight"]["grid"] == grid
    assert swept["tuning_seeds"] == [0]


# -- tiers ---------------------------------------------------------------------------------------------
def test_tiered_cache_demotes_down_the_tiers_and_reports_each_move():
    from kv_index.nodes import PrefixMatch
    from router.replay.simulator import TieredCache

    def insert(hashes):
        stored, removed = c.insert(hashes)
        return {t: sorted(hs) for t, hs in stored.items()}, {t: sorted(hs) for t, hs in removed.items()}

    c = TieredCache(2, 2, 1)  # blocks: device 2, host 2, disk 1
    assert insert([1, 2]) == ({0: [1, 2]}, {})
    # 1, 2 move to host memory
    assert insert([3, 4]) == ({0: [3, 4], 1: [1, 2]}, {0: [1, 2]})
    # 3, 4 to host; host's least recent (the chain's tail 2, then 1) to disk, which keeps 1
    assert insert([5, 6]) == ({0: [5, 6], 1: [3, 4], 2: [1]}, {0: [3, 4], 1: [1, 2]})
    assert (c.match([1, 2]), c.match([3, 4]), c.match([5, 6])) == (PrefixMatch(1, 0, 1), PrefixMatch(2, 2, 0),
                                                                   PrefixMatch(2, 0, 0))
    # 1 back from disk (onboarded), 2 computed again; 5, 6 to host, 3 to disk, 4 dropped
    assert insert([1, 2]) == ({0: [1, 2], 1: [5, 6], 2: [3]}, {0: [5, 6], 1: [3, 4], 2: [1]})
    assert [c.tier_of(h) for h in range(1, 7)] == [0, 0, 2, None, 1, 1]


def test_simulated_node_hits_each_tier_exactly_and_the_book_learns_the_onboards():
    """One prefill node, device / host / disk of 2 / 2 / 4 blocks, two-block conversations A-D:

        A B C D   misses            device D, host C, disk A B
        A         disk hit (64)     device A, host D, disk B C
        C         disk hit (64)     device C, host A, disk B D
        A         host hit (64)     device A, host C, disk B D
        A         device hit (64)
    """
    cfg = SimConfig(prefill_nodes=1, decode_nodes=1, block_size=32, cache_tokens=64, host_cache_tokens=64,
                    disk_cache_tokens=128, speed_spread=0.0, step_noise=0.0)
    chains = {"A": (1, 2), "B": (3, 4), "C": (5, 6), "D": (7, 8)}
    order = "ABCDACAA"
    reqs = [TraceRequest(10.0 * i, 64, 4, chains[k]) for i, k in enumerate(order)]
    costs = CostBook()
    res = simulate("rr", reqs, cfg, RoundRobin(), costs, None, admission="none", scale=1.0)
    assert dict(res.hit_tokens) == {"device": 64, "host": 64, "disk": 128, "remote": 0}
    assert res.cached_tokens == 256 and res.summary()["hit_ratio"] == pytest.approx(256 / 512)
    # the disk hits waited for their onboard: the truth's fixed cost + bytes at its bandwidth
    disk_s = cfg.tiers.disk_s(64 * cfg.kv_bytes_per_token)
    assert res.ttft_s[4] - res.ttft_s[7] == pytest.approx(disk_s, rel=1e-6)
    fits = {(v.node_id, v.tier): v.onboards for v in costs.onboard_fits()}
    assert fits == {("", "host"): 1, ("", "disk"): 2, ("prefill-0", "host"): 1, ("prefill-0", "disk"): 2}


def test_the_global_pool_gets_every_tier_of_every_node():
    cfg = SimConfig(prefill_nodes=2, decode_nodes=1, block_size=32, cache_tokens=64, host_cache_tokens=64,
                    disk_cache_tokens=0, speed_spread=0.0, step_noise=0.0)
    reqs = [TraceRequest(10.0 * i, 64, 4, (2 * k + 1, 2 * k + 2)) for i, k in enumerate([0, 1, 2, 3, 0])]
    res = simulate("pool", reqs, cfg, None, CostBook(), None, admission="none", scale=1.0, global_pool=True)
    # 4 conversations of 2 blocks fill device 4 + host 4: the first is in host memory when it returns
    assert dict(res.hit_tokens) == {"device": 0, "host": 64, "disk": 0, "remote": 0}


@needs_traces
def test_replay_with_tiers_reports_hits_per_tier(redis_url):
    out = _run(redis_url, CONV, 300, "--cache-tokens", "100000", "--host-cache-tokens", "200000",
               "--disk-cache-tokens", "800000", "--admission", "none", "--policies", "pdserve", "pdserve_no_fetch",
               "dynamo_kv", "llmd_weighted", "global_pool", "--seeds", "0")
    assert out["config"]["host_cache_tokens"] == 200_000 and out["config"]["disk_cache_tokens"] == 800_000
    one = _table(out)
    pol = one["policies"]
    for name, s in pol.items():
        assert set(s["hit_tokens"]) == {"device", "host", "disk", "remote"}
        assert sum(s["hit_tokens"].values()) == pytest.approx(s["hit_ratio"] * sum(
            r.input_tokens for r in load_trace(CONV, 300)), abs=1), name
        assert s["hit_vs_global_pool"] == pytest.approx(s["hit_ratio"] / one["global_pool_hit_ratio"])
    lower = pol["pdserve_no_fetch"]["hit_tokens"]
    assert lower["host"] > 0 and lower["disk"] > 0  # the small device pools spill into both tiers
    assert pol["pdserve"]["hit_tokens"]["remote"] > 0 and pol["pdserve_no_fetch"]["hit_tokens"]["remote"] == 0
    assert pol["llmd_weighted"]["redis_rtt_per_request"] == 1.0  # with tiers: the precise scorer, on the index
    assert pol["pdserve"]["index_exact_fraction"] >= 0.95  # the index's tiers match the nodes'


@pytest.mark.parametrize("share_s, sees_all", [(0.1, True), (None, False)])
def test_router_replicas_see_each_others_ledgers_only_when_shared(share_s, sees_all):
    """Eight 20k-token prompts 1 ms apart, then a ninth at 0.5 s, over two replicas: shared (a
    tick has passed) the ninth's router sees all eight in flight, as one router would; unshared
    it sees only those it placed itself (the seed's draw puts them on both)."""
    cfg = SimConfig(prefill_nodes=2, decode_nodes=1, speed_spread=0.0, step_noise=0.0)
    reqs = [TraceRequest(i * 0.001, 20_000, 10) for i in range(8)] + [TraceRequest(0.5, 20_000, 10)]
    costs = CostBook()
    pol = Recorder(costs)
    simulate("rec", reqs, cfg, pol, costs, None, admission="none", scale=1.0, routers=2, share_s=share_s)
    predicted = costs.prior.predict(20_000)
    seen = sum(pol.seen[-1][1].values())
    if sees_all:
        assert seen == pytest.approx(8 * predicted)
    else:
        assert 0 < seen < 8 * predicted - predicted / 2
    with pytest.raises(ValueError, match="routers must be >= 1"):
        simulate("rec", reqs, cfg, pol, costs, None, routers=0)
    with pytest.raises(ValueError, match="share_s must be > 0"):
        simulate("rec", reqs, cfg, pol, costs, None, routers=2, share_s=0.0)


@needs_traces
def test_replay_with_router_replicas_reports_ratios_and_its_check(redis_url):
    out = _run(redis_url, CONV, 120, "--routers", "2,3", "--seeds", "0,1", "--admission", "none")
    rep = out["replicas"]["none"]
    assert set(rep["ratios"]) == {"2_shared", "2_unshared", "3_shared", "3_unshared"}
    assert rep["ratios"]["2_shared"]["goodput_rps"]["n"] == 2 and rep["share_s"] == 0.5
    assert "shared_beats_unshared_at_3" in rep["check"] and isinstance(out["passed"], bool)
    with pytest.raises(SystemExit):
        _run(redis_url, CONV, 10, "--routers", "1")


def test_spread_arrivals_moves_each_within_its_bucket_the_same_way_every_time():
    from bench.router_replicas import spread_arrivals

    reqs = [TraceRequest(t, 100 + i, 10) for i, t in enumerate([0.0] * 5 + [3.0] * 5)]
    a, b = spread_arrivals(reqs, 3.0), spread_arrivals(reqs, 3.0)
    assert a == b and [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    by_tokens = {r.input_tokens: r.arrival_s for r in a}
    assert all(0.0 <= by_tokens[r.input_tokens] - r.arrival_s < 3.0 for r in reqs)
    assert len({r.arrival_s for r in a}) == 10 and spread_arrivals(reqs, 0.0) == reqs
