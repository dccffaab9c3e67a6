"""`pdserve bench router`'s method, on hand-built cases: the interval over seeds, the
edge-of-grid check on the tuned constants, the policy-neutral gate, seeds and the shared tier."""
from __future__ import annotations

import math

import pytest

from bench.router_report import section
from bench.router_stats import excludes, interval, over_seeds, paired_ratios, t_critical
from bench.router_tuning import KNOBS, TIERED_KNOBS, Knob, best, position, sweep, tuning_check
from router.admission import SLO_CLASSES, Estimate
from router.cost_model import CostBook
from router.placement import Placement, PlacementPolicy
from router.replay.baselines import RoundRobin
from router.replay.simulator import SimConfig, simulate
from router.replay.traces import TraceRequest


# -- the interval ------------------------------------------------------------------------------------
def test_t_interval_of_five_values():
    iv = interval([1.0, 2.0, 3.0, 4.0, 5.0])
    half = 2.776 * math.sqrt(2.5) / math.sqrt(5)  # t(0.975, 4) x sd / sqrt(n)
    assert (iv["mean"], iv["n"]) == (3.0, 5)
    assert iv["lo"] == pytest.approx(3.0 - half) and iv["hi"] == pytest.approx(3.0 + half)
    assert excludes(iv, 0.9) and not excludes(iv, 3.5)


def test_interval_edge_cases():
    one = interval([2.0])
    assert one["mean"] == 2.0 and math.isnan(one["lo"]) and math.isnan(one["hi"])
    assert not excludes(one, 0.0)  # one seed resolves nothing
    same = interval([4.0] * 5)
    assert same["lo"] == same["hi"] == 4.0
    with_nan = interval([1.0, math.nan, 3.0])
    assert (with_nan["n"], with_nan["dropped_nan"], with_nan["mean"]) == (2, 1, 2.0)
    assert math.isnan(interval([])["mean"])
    assert t_critical(1) == pytest.approx(12.706) and t_critical(100) == pytest.approx(1.960)
    assert math.isnan(t_critical(0))


def test_ratios_are_paired_seed_by_seed():
    # B is twice A on every seed, while both swing widely across seeds: the ratio is exact.
    tables = [{"a": {"g": 2.0 * k}, "b": {"g": 1.0 * k}} for k in (1, 5, 9, 13, 17)]
    r = paired_ratios(tables, "a", ["b", "missing"], "g")
    assert set(r) == {"b"} and r["b"]["mean"] == pytest.approx(2.0)
    assert r["b"]["lo"] == pytest.approx(2.0) and r["b"]["hi"] == pytest.approx(2.0)
    per = over_seeds(tables, ["g"])
    assert per["a"]["g"]["mean"] == pytest.approx(18.0) and per["a"]["g"]["hi"] - per["a"]["g"]["lo"] > 10


def test_the_policy_and_capability_results_compare_like_with_like():
    names = ("pdserve", "pdserve_no_fetch", "least_loaded", "sglang_cache_aware", "dynamo_kv", "llmd_weighted")
    tables = [{n: {"goodput_rps": 1.0 + 0.1 * i + (0.2 if n.startswith("pdserve") else 0.0), "ttft_mean_s": 1.0,
                   "ttft_p99_s": 2.0} for i, n in enumerate(names)} for _ in range(5)]
    for t in tables:
        t.update({p + "+fetch": t[p] for p in names[2:]})
    sec = section("none", tables)
    assert sec["policy_result"]["pdserve"] == "pdserve_no_fetch"
    assert sec["policy_result"]["ratios"]["dynamo_kv"]["against"] == "dynamo_kv"
    assert sec["capability_result"]["pdserve"] == "pdserve"
    assert sec["capability_result"]["ratios"]["dynamo_kv"]["against"] == "dynamo_kv+fetch"
    assert sec["policy_result"]["ratios"]["least_loaded"]["goodput_rps"]["mean"] == pytest.approx(1.3 / 1.2)


# -- the edge-of-grid check --------------------------------------------------------------------------
def test_an_optimum_on_the_grid_edge_fails_the_check():
    assert position((1.0, 2.0, 4.0), 2.0) == "interior"
    assert position((1.0, 2.0, 4.0), 4.0) == "grid_edge"  # more might be better: widen the grid
    assert position((1.0, 2.0, 4.0), 1.0) == "grid_edge"  # the domain goes down to 0
    assert position((0.0, 1.0, 2.0), 0.0) == "domain_bound"  # nothing below a weight of 0
    assert position((0.1, 0.5, 1.0), 1.0, (0.0, 1.0)) == "domain_bound"
    with pytest.raises(ValueError):
        position((1.0, 2.0), 3.0)
    space = {"w": Knob((1.0, 2.0, 4.0), 2.0), "t": Knob((0.1, 0.5, 0.9), 0.5, (0.0, 1.0))}
    assert tuning_check(space)["interior"]
    edge = tuning_check(space, {"t": 0.9})
    assert not edge["interior"] and edge["knobs"]["t"]["position"] == "grid_edge"
    assert edge["constants"] == {"w": 2.0, "t": 0.9}


class _Report:
    def progress(self, msg):
        self.last = msg

    def table(self, headers, rows):
        pass


def test_a_sweep_whose_best_is_at_the_edge_says_so(monkeypatch):
    monkeypatch.setitem(KNOBS, "toy", {"w": Knob((1.0, 2.0, 4.0), 2.0)})

    def measure(name, c, seed):  # goodput rises with w: the best is the largest value tried
        return {"goodput_rps": c["w"] + 0.01 * seed, "ttft_mean_s": 1.0, "ttft_p99_s": 2.0, "rejected": 0,
                "hit_ratio": 0.0}

    rep = _Report()
    out = sweep(["toy", "round_robin"], False, (0, 1), measure, rep)
    assert out["chosen"] == {"toy": {"w": 4.0}} and not out["all_interior"]
    assert out["tuning_check"]["toy"]["knobs"]["w"]["position"] == "grid_edge" and "widen" in rep.last
    assert out["tuning"]["toy"][2]["goodput_rps"] == pytest.approx(4.005)  # the mean over the seeds


def test_the_tuning_rule_breaks_goodput_ties_by_mean_ttft():
    runs = [{"constants": {"w": 1}, "goodput_rps": 5.00001, "ttft_mean_s": 2.0},
            {"constants": {"w": 2}, "goodput_rps": 5.00002, "ttft_mean_s": 1.0},
            {"constants": {"w": 4}, "goodput_rps": 4.9, "ttft_mean_s": 0.5}]
    assert best(runs)["constants"] == {"w": 2}


def test_every_tabled_constant_is_interior_to_its_grid():
    for table in (KNOBS, TIERED_KNOBS):
        for name, space in table.items():
            check = tuning_check(space)
            assert check["interior"], (name, check["knobs"])


# -- the policy-neutral gate -------------------------------------------------------------------------
class _Fixed(PlacementPolicy):
    """Every request to prefill-0, carrying ``estimate`` (a model's prediction, or none)."""

    uses_index = False

    def __init__(self, estimate: Estimate | None) -> None:
        self.estimate = estimate

    def choose(self, request, nodes, matched_blocks, backlog_s=None) -> Placement:
        p = next(n for n in nodes if n.node_id == "prefill-0")
        d = next(n for n in nodes if n.role == "decode")
        return Placement(p, d, 0, "fixed", self.estimate)


def _gated(policy: PlacementPolicy, admission: str, fraction: float = 1.0):
    cfg = SimConfig(prefill_nodes=2, decode_nodes=1, speed_spread=0.0, step_noise=0.0,
                    gate_queue_fraction=fraction)
    reqs = [TraceRequest(i * 0.001, 20_000, 10) for i in range(8)]
    return simulate("fixed", reqs, cfg, policy, CostBook(), None, admission=admission, scale=1.0)


def test_the_queue_bound_is_the_same_rule_whatever_the_policy_predicts():
    """Eight 20k-token prompts at once on one node: each costs 1.569 s, its TTFT budget is 7 s.
    The queue bound admits the first five (waits 0 to 6.3 s) and rejects the rest, whether the
    policy's estimate is honest, absurdly optimistic or absent; pdserve's model gate trusts a
    policy's own estimate."""
    cost = SimConfig().truth.seconds(20_000)
    budget = SLO_CLASSES["standard"].ttft_budget_s(20_000)
    assert 4 * cost <= budget < 5 * cost
    optimistic, pessimistic = Estimate(), Estimate(queue_s=100.0)
    runs = [_gated(_Fixed(e), "queue_bound") for e in (None, optimistic, pessimistic)]
    rejected = [[math.isnan(x) for x in r.ttft_s] for r in runs]
    assert rejected[0] == rejected[1] == rejected[2] == [False] * 5 + [True] * 3
    assert _gated(_Fixed(optimistic), "pdserve_model").rejected == 0
    assert _gated(_Fixed(pessimistic), "pdserve_model").rejected == 8
    assert _gated(_Fixed(None), "queue_bound", fraction=0.5).rejected == 5  # waits 0, 1.57, 3.14 fit 3.5 s
    assert _gated(_Fixed(None), "none").rejected == 0


# -- seeds and the shared tier -----------------------------------------------------------------------
def test_a_seed_shuffles_the_node_speeds_and_seed_zero_keeps_their_order():
    base = SimConfig(prefill_nodes=8)
    speeds = [base.speed(i) for i in range(8)]
    assert speeds == sorted(speeds) and speeds[0] == pytest.approx(0.8)
    for seed in (1, 2, 3):
        cfg = SimConfig(prefill_nodes=8, seed=seed)
        assert sorted(cfg.speed_rank(i) for i in range(8)) == list(range(8))
        assert sorted(cfg.speed(i) for i in range(8)) == pytest.approx(speeds)
    assert [SimConfig(seed=1).speed(i) for i in range(8)] != [SimConfig(seed=2).speed(i) for i in range(8)]


def test_a_peer_with_the_shared_tier_fetches_what_another_node_holds():
    cfg = SimConfig(prefill_nodes=2, decode_nodes=1, block_size=32, speed_spread=0.0, step_noise=0.0)
    reqs = [TraceRequest(10.0 * i, 96, 4, (1, 2, 3)) for i in range(2)]  # round robin: node 0, then node 1
    plain = simulate("rr", reqs, cfg, RoundRobin(), CostBook(), None, scale=1.0)
    shared = simulate("rr+fetch", reqs, cfg, RoundRobin(), CostBook(), None, scale=1.0, shared_fetch=True)
    assert plain.hit_tokens["remote"] == 0 and plain.cached_tokens == 0
    assert shared.hit_tokens["remote"] == 96 and shared.fetched_tokens == 96
    fetch_s = 96 * cfg.kv_bytes_per_token / cfg.bandwidth  # fetch's bandwidth, what pdserve's fetch moves at
    compute_s = cfg.truth.seconds(96)
    assert plain.ttft_s[1] - shared.ttft_s[1] == pytest.approx(compute_s - fetch_s)
