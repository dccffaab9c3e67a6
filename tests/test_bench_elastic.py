"""`pdserve bench serve --compare elastic`'s pure parts: the phases file, the A B C C B A
schedule, what counts as dropped, role switches and the summary arithmetic (no cluster; the
benchmark itself is run by hand, docs/benchmarks.md)."""
from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest

from bench.serve import phases as ph
from bench.serve import run as serve
from bench.serve.elastic import figures as fig
from bench.serve.elastic import rate as serve_elastic_rate
from bench.serve.elastic import run as serve_elastic
from bench.serve.metrics import Record, Slo


def test_the_shipped_phases_file_plays_chat_documents_and_a_burst():
    phases = ph.load_phases(ph.DEFAULT_FILE)
    assert [p.name for p in phases] == ["chat", "documents", "burst"]
    assert phases[0].long_share < phases[1].long_share and phases[2].rate == max(p.rate for p in phases)
    reqs = ph.phased(phases, seed=4)
    assert reqs == ph.phased(phases, seed=4)  # a seed is a workload
    assert all(a.arrival_s < b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert 0 < reqs[0].arrival_s and reqs[-1].arrival_s < ph.total_seconds(phases)
    per_phase = [[r for r in reqs if ph.phase_index(phases, r.arrival_s) == i] for i in range(3)]
    for p, rs in zip(phases, per_phase):
        assert len(rs) == pytest.approx(p.rate * p.seconds, rel=0.5)
    share = [sum(r.kind == "long" for r in rs) / len(rs) for rs in per_phase]
    assert share[0] < share[1]
    assert ph.starts(phases) == [0.0, phases[0].seconds, phases[0].seconds + phases[1].seconds]
    assert ph.phase_index(phases, 1e9) == 2


@pytest.mark.parametrize("data, message", [
    ({}, "expected a non-empty JSON list of phases, got an object"),
    ([], "expected a non-empty JSON list"),
    ([5], "phase 1: expected an object with seconds, rate, long_share, got 5"),
    ([{"seconds": 5, "rate": 1}], "phase 1: missing field(s) 'long_share'"),
    ([{"seconds": 5, "rate": 1, "long_share": 0.2, "burst": 3}], "phase 1: unknown field(s) 'burst'"),
    ([{"seconds": 5, "rate": 1, "long_share": 0.2}, {"seconds": 0, "rate": 1, "long_share": 0.2}],
     "phase 2: 'seconds' must be > 0, got 0"),
    ([{"seconds": 5, "rate": -1, "long_share": 0.2}], "'rate' must be > 0 (requests per second), got -1"),
    ([{"seconds": 5, "rate": True, "long_share": 0.2}], "'rate' must be a finite number, got True"),
    ([{"seconds": 5, "rate": "2", "long_share": 0.2}], "'rate' must be a finite number, got '2'"),
    ([{"seconds": float("inf"), "rate": 1, "long_share": 0.2}], "'seconds' must be a finite number"),
    ([{"seconds": 5, "rate": 1, "long_share": 1.5}], "'long_share' must be in [0, 1], got 1.5"),
    ([{"seconds": 5, "rate": 1, "long_share": 0.5, "name": 3}], "'name' must be a string"),
])
def test_a_bad_phases_file_is_refused_naming_the_file_phase_and_field(data, message):
    with pytest.raises(ph.PhasesError) as e:
        ph.parse_phases(data, "my.json")
    assert str(e.value).startswith("my.json: ") and message in str(e.value)


def test_phases_file_errors_name_the_file(tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(ph.PhasesError, match="none.json: cannot read"):
        ph.load_phases(missing)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"seconds": 5,')
    with pytest.raises(ph.PhasesError, match=r"broken.json: not valid JSON \(line 1"):
        ph.load_phases(broken)
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"seconds": 3, "rate": 2, "long_share": 0}]))
    assert ph.load_phases(good) == [ph.Phase(3.0, 2.0, 0.0)]


def test_layouts_run_a_b_c_c_b_a():
    assert fig.schedule(["fixed", "colocated", "elastic"]) == [
        (0, "fixed"), (0, "colocated"), (0, "elastic"), (1, "elastic"), (1, "colocated"), (1, "fixed")]
    assert fig.schedule(["a"]) == [(0, "a"), (1, "a")]
    for bad in ([], ["a", "a"]):
        with pytest.raises(ValueError):
            fig.schedule(bad)


def rec(i, out=4, error=None, ttft=0.5, streamed=None, end=None, kind="chat"):
    r = Record(i, kind, 10, 4, float(i), float(i), None if error else i + ttft,
               end if end is not None else (None if error else i + ttft + 0.3), 0 if error else out, error=error)
    r.streamed_tokens = r.output_tokens if streamed is None else streamed
    return r


def test_dropped_is_sent_minus_completed_or_refused_with_a_reason():
    records = [rec(0), rec(1), rec(2, error="ResourceExhaustedError: overloaded; retry in 1 s"),
               rec(3, error="StreamInterruptedError: decode node lost"), rec(4, error="stream ended without a completion"),
               rec(5, out=3), rec(6, streamed=5)]
    c = fig.counts(records)
    assert c == {"sent": 7, "completed": 4, "refused": 1, "dropped": 2, "mismatched": 2}


def test_goodput_pools_the_passes_over_their_durations():
    slo = Slo(ttft_s=1.0, tpot_s=1.0)
    a = [rec(0), rec(1, ttft=2.0)]  # 0..0.8 and 1..3.3: 3.3 s, one good
    b = [rec(0), rec(1), rec(2, error="UnavailableError: x")]  # 0..1.8: 1.8 s, two good
    p = fig.pooled([a, b], slo)
    assert p["good"] == 3 and p["seconds"] == pytest.approx(5.1)
    assert p["goodput_rps"] == pytest.approx(3 / 5.1) and p["slo_attainment"] == pytest.approx(3 / 5)
    assert p["goodput_rps_by_pass"] == pytest.approx([1 / 3.3, 2 / 1.8])
    assert fig.pooled([[]], slo)["goodput_rps"] == 0.0


def test_role_switches_count_changes_and_skip_gaps():
    samples = [(0.0, {"p": "prefill", "d": "decode"}), (0.5, {"d": "decode"}),  # p re-registering
               (1.0, {"p": "decode", "d": "decode"}), (1.5, {"p": "decode", "d": "decode"}),
               (2.0, {"p": "prefill", "d": "decode"})]
    assert fig.role_switches(samples) == 2
    assert fig.role_counts(samples, "prefill") == [(0.0, 1), (0.5, 0), (2.0, 1)]
    assert fig.role_counts(samples[:4], "decode") == [(0.0, 1), (1.0, 2), (1.5, 2)]
    assert fig.role_switches([]) == 0


def test_summary_takes_the_worst_mix_and_the_phases_ratio_and_sums_elastic_drops():
    def w(kind, goodput, dropped=0):
        by = {name: {"goodput_rps": g, "dropped": dropped if name == "elastic" else 5}
              for name, g in zip(("fixed", "colocated", "elastic"), goodput)}
        return {"kind": kind, "by_layout": by, **fig.vs_best_static({k: v["goodput_rps"] for k, v in by.items()})}

    loads = [w("mix", (0.4, 0.8, 0.78)), w("mix", (1.0, 0.5, 1.1)), w("phases", (0.5, 0.6, 0.9), dropped=1)]
    assert loads[0]["best_static"] == "colocated" and loads[1]["best_static"] == "fixed"
    s = fig.summary(loads)
    assert s["elastic_vs_best_static_min"] == pytest.approx(0.78 / 0.8)
    assert s["elastic_vs_best_static_phases"] == pytest.approx(1.5)
    assert s["dropped"] == 1
    assert s["met"] == {"elastic_vs_best_static_min": True, "elastic_vs_best_static_phases": True, "dropped": False}
    # No static layout within the SLO: the ratio, and so the min, is undefined, not infinite.
    s = fig.summary([w("mix", (0.0, 0.0, 0.3))])
    assert s["elastic_vs_best_static_min"] is None and s["met"]["elastic_vs_best_static_min"] is None
    assert s["elastic_vs_best_static_phases"] is None
    assert fig.vs_best_static({"fixed": 1.0}) == {"best_static": "fixed", "elastic_vs_best_static": None}
    assert fig.vs_best_static({"elastic": 1.0}) == {"best_static": None, "elastic_vs_best_static": None}


def test_the_phase_oracle_runs_each_phases_best_static_layout():
    # Colocated serves the chat phase best, fixed the documents phase: switching at the boundary
    # serves 30 + 20 where the better static layout (colocated, 30 + 5) serves 35.
    good = {"fixed": [10.0, 20.0, 0.0], "colocated": [30.0, 5.0, 0.0], "elastic": [99.0, 99.0, 99.0]}
    assert fig.phase_oracle(good) == pytest.approx(50 / 35)
    assert fig.phase_oracle({"fixed": [1.0, 2.0], "colocated": [0.5, 1.0]}) == 1.0  # one layout wins everywhere
    assert fig.phase_oracle({"fixed": [0.0], "colocated": [0.0]}) is None
    assert fig.phase_oracle({"elastic": [3.0]}) is None
    loads = [{"kind": "phases", "by_layout": {}, "elastic_vs_best_static": 0.9, "phase_oracle_vs_best_static": 1.1}]
    assert fig.summary(loads)["oracle_vs_best_static_phases"] == 1.1


def test_planner_decisions_are_read_from_the_router_metrics_and_cut_by_time():
    text = "\n".join([
        "# HELP pdserve:planner_decisions_total Planner rounds",
        'pdserve:planner_decisions_total{action="hold",model_name="m",reason="cooldown"} 3.0',
        'pdserve:planner_decisions_total{action="hold",model_name="m",reason="no_gain"} 2.0',
        'pdserve:planner_decisions_total{action="switch_roles",model_name="m",reason="decode_bound"} 1.0',
        'pdserve:planner_decisions_created{action="hold",model_name="m",reason="cooldown"} 1.7e9',
    ])
    assert fig.planner_decisions(text) == {"hold/cooldown": 3.0, "hold/no_gain": 2.0, "switch_roles/decode_bound": 1.0}
    ticks = [(0.0, {"hold": 1.0}), (5.0, {"hold": 3.0}), (10.0, {"hold": 4.0, "switch_roles": 1.0}),
             (20.0, {"hold": 9.0, "switch_roles": 1.0})]
    assert fig.counter_delta(ticks, 0.0, 10.0) == {"hold": 2.0}
    assert fig.counter_delta(ticks, 10.0, math.inf) == {"hold": 5.0}
    assert fig.counter_delta(ticks, 7.0, 12.0) == {"hold": 1.0, "switch_roles": 1.0}
    assert fig.counter_delta([], 0.0, 1.0) == {}
    assert fig.between(ticks, 5.0, 20.0) == ticks[1:3]


def _args(*argv) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(["--compare", "elastic", *argv])


def test_the_mixes_play_back_to_back_with_a_lead_and_each_pass_draws_its_half():
    args = _args("--long-shares", "0.1,0.4", "--rate", "2", "--mix-seconds", "10", "--lead-s", "5")
    mixes, play = serve_elastic.streams(args)
    assert [(s.workload, s.start, s.measured_from, s.end) for s in mixes.segments] == [
        ("long_share=0.1", 0.0, 5.0, 15.0), ("long_share=0.4", 15.0, 20.0, 30.0)]
    first, second = mixes.requests(0, None), mixes.requests(1, None)
    assert first == mixes.requests(0, None) and first != second  # the same for every layout, halves differ
    assert 10 < sum(r.arrival_s >= 20 for r in first) < 30 and max(r.arrival_s for r in first + second) < 30
    docs = [r for r in first if r.arrival_s >= 15]
    assert sum(r.kind == "long" for r in docs) > sum(r.kind == "long" for r in first if r.arrival_s < 15)
    assert play.requests(0, None) == play.requests(1, None)  # the phases play: the same in both passes
    assert [s.workload for s in play.segments] == ["phases"] and play.segments[0].end == 100.0
    assert [lay.name for lay in serve_elastic.layouts(args)] == ["fixed", "colocated", "elastic"]
    with pytest.raises(SystemExit, match="unknown"):
        serve_elastic.layouts(_args("--elastic-layouts", "fixed,both"))
    with pytest.raises(SystemExit, match="one setting"):
        serve_elastic.layouts(_args("--colocated-chunk-tokens", "256,512"))
    assert [s.name for s in serve_elastic.streams(_args("--phases", ""))] == ["mixes"]
    with pytest.raises(SystemExit, match="--phases: nowhere.json: cannot read"):
        serve_elastic.streams(_args("--phases", "nowhere.json"))
    with pytest.raises(SystemExit, match="--mix-seconds > 0"):
        serve_elastic.streams(_args("--mix-seconds", "0"))


def test_a_stream_is_cut_into_its_workloads_by_arrival_and_time():
    args = _args("--long-shares", "0.1,0.4", "--mix-seconds", "10", "--lead-s", "5", "--phases", "")
    (mixes,) = serve_elastic.streams(args)
    records = [rec(i) for i in range(0, 30, 2)]  # sent (scheduled) at 0, 2, ..., 28 s
    sampler = SimpleNamespace(
        samples=[(0.0, {"p": "prefill"}), (12.0, {"p": "decode"}), (16.0, {"p": "decode"}), (25.0, {"p": "prefill"})],
        thresholds=[(1.0, 256), (18.0, 2048)],
        decisions=[(0.0, {}), (14.0, {"hold": 6.0, "switch_roles": 1.0}), (31.0, {"hold": 12.0, "switch_roles": 2.0})],
        plans=[(2.0, "hold", "warming_up", "w"), (12.0, "switch_roles", "decode_bound", "d"), (16.5, "hold", "cooldown", "c")])
    runs = serve_elastic.cut(mixes, records, sampler)
    low, high = runs["long_share=0.1"], runs["long_share=0.4"]
    assert [r.scheduled_s for r in low.records] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert [r.scheduled_s for r in low.measured] == [6, 8, 10, 12, 14]
    assert [r.scheduled_s for r in high.measured] == [20, 22, 24, 26, 28]
    assert fig.role_switches(low.samples) == 1 and high.samples == [(1.0, {"p": "decode"}), (10.0, {"p": "prefill"})]
    assert high.thresholds == [(3.0, 2048)]
    assert low.decisions == {"hold": 6.0, "switch_roles": 1.0} and high.decisions == {"hold": 6.0, "switch_roles": 1.0}
    assert low.plans == [(2.0, "hold", "warming_up", "w"), (12.0, "switch_roles", "decode_bound", "d")]
    assert high.plans == [(1.5, "hold", "cooldown", "c")]


def test_the_plot_draws_goodput_and_the_roles_over_time(tmp_path):
    from bench.serve.elastic.plot import plot

    by = {name: {"grid_goodput_rps": g, "role_switches": 0, "dropped": 0} for name, g in
          (("fixed", 0.5), ("colocated", 0.7), ("elastic", 0.8))}
    by["elastic"] = {**by["elastic"], "role_switches": 2, "roles_over_time": [
        {"pass": 1, "prefill_nodes": [(0.0, 1), (12.0, 0), (30.0, 1), (60.0, 1)], "thresholds": [(0.0, 256), (12.0, 2048)]},
        {"pass": 2, "prefill_nodes": [(0.0, 1), (60.0, 1)], "thresholds": []}]}
    result = {"layouts": [{"name": n} for n in by], "elastic_vs_best_static_min": 1.1,
              "elastic_vs_best_static_phases": None,
              "phases": [{"name": "chat", "seconds": 25, "rate": 1.2, "long_share": 0.05},
                         {"name": "burst", "seconds": 35, "rate": 2.0, "long_share": 0.2}],
              "workloads": [{"name": "long_share=0.1", "kind": "mix", "by_layout": by},
                            {"name": "phases", "kind": "phases", "by_layout": by}]}
    plot(str(tmp_path / "run"), result)
    assert (tmp_path / "run_elastic.png").stat().st_size > 10_000


def test_the_layouts_share_two_pinned_cores_and_only_the_elastic_one_plans():
    args = _args("--planner-window-s", "20")
    configs = {lay.name: serve_elastic._cluster_config(args, lay) for lay in serve_elastic.layouts(args)}
    assert {n: (c.prefill_nodes, c.decode_nodes, c.planner) for n, c in configs.items()} == {
        "fixed": (1, 1, "off"), "colocated": (0, 2, "off"), "elastic": (1, 1, "active")}
    assert all(c.pin_cores and c.node_threads == 1 for c in configs.values())
    elastic = configs["elastic"]
    # No pool maxima: the planner moves roles between the two nodes and never adds a third.
    assert elastic.max_prefill_nodes is None and elastic.max_decode_nodes is None and not elastic.planner_resize
    assert (elastic.planner_interval_s, elastic.planner_cooldown_s, elastic.planner_window_s) == (2.0, 8.0, 20.0)
    assert configs["fixed"].short_prompt_tokens == elastic.short_prompt_tokens == 256
    # Each role on its static layout's step budget: the elastic nodes decode (and prefill beside
    # decodes) in colocated's chunks and prefill for others in the fixed prefill node's; the
    # fixed decode node on the elastic nodes' decode budget (elastic at 1P+1D is fixed exactly).
    budgets = {n: (c.engine.scheduler.max_num_batched_tokens, c.prefill_step_tokens) for n, c in configs.items()}
    assert budgets == {"fixed": (256, 512), "colocated": (256, None), "elastic": (256, 512)}
    lays = {lay.name: lay for lay in serve_elastic.layouts(_args("--fixed-decode-chunk-tokens", "512"))}
    assert (lays["fixed"].chunk_tokens, lays["fixed"].prefill_chunk_tokens) == (512, 512)
    lays = {lay.name: lay for lay in serve_elastic.layouts(_args("--elastic-chunk-tokens", "128"))}
    assert (lays["fixed"].chunk_tokens, lays["elastic"].chunk_tokens) == (128, 128)
    # The planner is told the SLO grid's middle point, what the layouts are scored around.
    assert (elastic.planner_ttft_slo_factor, elastic.planner_tpot_slo_factor) == (5.0, 3.0)
    assert serve_elastic.planner_slo(_args("--slo-grid-tpot-factors", "4,1.5")) == (5.0, 4.0)
    # ... and scores layouts across the grid's TPOT factors (the headline's mean), not its middle alone.
    assert elastic.planner_slo_band == (0.6667, 1.0, 1.3333)
    assert elastic.planner_config.slo_band == (0.6667, 1.0, 1.3333)
    # --static-planner advisory: the static layouts' routers decide too (and change nothing), each
    # layout's rounds recorded per pass.
    args = _args("--static-planner", "advisory", "--planner-records", "/tmp/r")
    lays = {lay.name: lay for lay in serve_elastic.layouts(args)}
    fixed = serve_elastic._cluster_config(args, lays["fixed"], 1)
    assert (fixed.planner, fixed.planner_record, fixed.planner_tpot_slo_factor) == ("advisory", "/tmp/r_fixed_pass2.jsonl", 3.0)
    assert serve_elastic._cluster_config(args, lays["elastic"], 0).planner == "active"
    assert configs["fixed"].planner_record is None
    with pytest.raises(SystemExit, match="need numbers > 0"):
        serve_elastic.grid_factors(_args("--slo-grid-ttft-factors", "0,3"))


def test_grid_goodput_is_the_mean_of_each_slo_points_pooled_goodput():
    """Two requests over 10 s of one pass: TPOT 0.09 s and 0.15 s (10 tokens, first token at
    0.1 s); with a TPOT bound of 0.1 one meets it, of 0.2 both: the grid's mean lies between."""
    def r(i, sent, tpot):
        return Record(i, "chat", 64, 10, sent, sent, first_token_s=sent + 0.1, end_s=sent + 0.1 + 9 * tpot,
                      output_tokens=10)
    a, b = r(0, 0.0, 0.09), r(1, 8.55, 0.15)  # b ends at 8.55 + 0.1 + 1.35 = 10.0
    g = fig.grid_goodput([[a, b]], [Slo(1.0, 0.1), Slo(1.0, 0.2)])
    assert g["grid_points"] == pytest.approx([0.1, 0.2]) and g["grid_goodput_rps"] == pytest.approx(0.15)


def test_the_elastic_planner_window_fits_the_workload():
    """By default the window is a mix's length (lead and measured), at most 30 s: the cluster's
    60 s would mostly hold the previous mix or phase when the planner settles on the next one,
    and a much shorter one holds too few requests to tell the layouts apart."""
    def window(*argv):
        args = _args(*argv)
        lay = next(x for x in serve_elastic.layouts(args) if x.planner != "off")
        return serve_elastic._cluster_config(args, lay).planner_window_s
    assert window() == 30.0  # lead 20 + 40 measured, capped
    assert window("--lead-s", "5", "--mix-seconds", "10") == 15.0
    assert window("--lead-s", "0", "--mix-seconds", "8") == 8.0
    assert window("--lead-s", "40", "--planner-window-s", "12") == 12.0


def test_without_rate_the_load_follows_the_machines_unloaded_tpot():
    """A machine twice as slow gets half the rate, the phases scaled alike; --rate plays as given."""
    def unloaded(*tpots):
        # One token, then the rest 1/tpot apart: the record's TPOT is exactly ``tpot``.
        return [rec(i, out=11, end=i + 0.5 + 10 * t) for i, t in enumerate(tpots)]

    assert serve_elastic_rate.auto_rate(unloaded(0.1, 0.04, 0.12)) == pytest.approx(serve_elastic_rate.RATE_X_TPOT / 0.1, abs=1e-3)
    slow = serve_elastic_rate.auto_rate(unloaded(0.2))
    assert slow == pytest.approx(serve_elastic_rate.auto_rate(unloaded(0.1)) / 2, abs=1e-3)
    with pytest.raises(SystemExit, match="pass --rate"):
        serve_elastic_rate.auto_rate([rec(0, out=1)])  # a single token: no TPOT
    assert "the unloaded TPOT 100 ms" in serve_elastic_rate.rate_rule(unloaded(0.1), serve_elastic_rate.auto_rate(unloaded(0.1)))
    written = ph.load_phases(ph.DEFAULT_FILE)
    mixes, play = serve_elastic.streams(_args("--long-shares", "0.1"), slow)
    assert {p.rate for p in mixes.phases} == {slow}
    scale = slow / serve_elastic.PHASES_REFERENCE_RATE
    assert [p.rate for p in play.phases] == pytest.approx([p.rate * scale for p in written])
    mixes, play = serve_elastic.streams(_args("--long-shares", "0.1", "--rate", "0.7"), slow)
    assert {p.rate for p in mixes.phases} == {0.7} and [p.rate for p in play.phases] == [p.rate for p in written]


def test_a_phases_workload_reports_each_phases_good_requests_and_the_oracle():
    """Two phases of 10 s, two requests each, and a grid of two SLOs, the loose one met by
    every request: fixed meets the tight one only in the second phase, colocated only in the
    first. Each serves 3 of 4 a phase-mean; running colocated then fixed would serve 4."""
    from bench.serve.elastic.results import workload_result
    from bench.serve.elastic.run import ElasticLayout
    from bench.serve.elastic.streams import Run, Segment, Stream

    def r(i, sent, tpot):
        return Record(i, "chat", 64, 10, sent, sent, first_token_s=sent + 0.1, end_s=sent + 0.1 + 9 * tpot,
                      output_tokens=10)

    slow, fast = 0.5, 0.05
    served = {"fixed": [r(0, 1, slow), r(1, 2, slow), r(2, 12, fast), r(3, 13, fast)],
              "colocated": [r(0, 1, fast), r(1, 2, fast), r(2, 12, slow), r(3, 13, slow)],
              "elastic": [r(0, 1, fast), r(1, 2, fast), r(2, 12, fast), r(3, 13, slow)]}
    phases = (ph.Phase(10.0, 0.2, 0.0, "chat"), ph.Phase(10.0, 0.2, 0.5, "documents"))
    stream = Stream("phases", phases, (Segment("phases", "phases", 0.0, 0.0, 20.0),), 0, per_pass=False)
    lays = [ElasticLayout(n, 1, 1, "off", 256, 256) for n in served]
    runs = {(n, "phases"): [Run(rs, rs, [], [], {}, [])] for n, rs in served.items()}
    grid = [(5.0, 2.0, Slo(1.0, 0.1)), (5.0, 4.0, Slo(1.0, 0.6))]  # the loose point takes every request
    out = workload_result(stream, stream.segments[0], lays, runs, Slo(1.0, 0.1), grid)
    assert [p["good_grid"] for p in out["by_layout"]["fixed"]["by_phase"]] == [1.0, 2.0]  # (0 + 2) / 2, (2 + 2) / 2
    assert [p["good_grid"] for p in out["by_layout"]["colocated"]["by_phase"]] == [2.0, 1.0]
    assert out["phase_oracle_vs_best_static"] == pytest.approx((2.0 + 2.0) / 3.0)
    assert out["by_layout"]["elastic"]["by_phase"][1]["slo_attainment"] == 0.5


def test_a_warmup_slot_runs_first_unmeasured_and_sets_the_rate(monkeypatch):
    """--warmup-s: the schedule's first layout serves an unmeasured slot first, and its unloaded
    TPOT sets the rate; without it the first measured slot's does (the A/A run's first slot
    served 1.2-1.6x less than an identical second one)."""
    def unloaded(tpot):
        return [rec(0, out=11, end=0.5 + 10 * tpot)]

    class Stop(Exception):
        pass

    def run(*argv):
        calls = []
        monkeypatch.setattr(serve_elastic, "_warmup_slot",
                            lambda args, layout, report: calls.append(("warm-up", layout.name)) or unloaded(0.1))

        def slot(args, layout, pass_index, plan_for, report):
            calls.append((layout.name, pass_index, plan_for(unloaded(0.2))[0].phases[0].rate))
            raise Stop

        monkeypatch.setattr(serve_elastic, "_slot", slot)
        with pytest.raises(Stop):
            serve_elastic.compare_elastic(_args("--long-shares", "0.1", *argv), SimpleNamespace(progress=print))
        return calls

    fast, slow = serve_elastic_rate.RATE_X_TPOT / 0.1, serve_elastic_rate.RATE_X_TPOT / 0.2
    assert run() == [("warm-up", "fixed"), ("fixed", 0, pytest.approx(fast, abs=1e-3))]
    assert run("--warmup-s", "0") == [("fixed", 0, pytest.approx(slow, abs=1e-3))]
    assert run("--elastic-layouts", "colocated,fixed") == [("warm-up", "colocated"),
                                                          ("colocated", 0, pytest.approx(fast, abs=1e-3))]


def test_the_rate_follows_the_prefill_too_where_it_is_the_slower_side():
    """Decode and prefill do not speed up alike across CPUs: where a document's unloaded TTFT
    would put the fixed layout's prefill node past ``RATE_X_LONG_TTFT`` of documents' time a
    second, that sets the rate (the EPYC of 2026-12-04: TPOT 40 ms, a document 2.45 s)."""
    def unloaded(tpot, long_ttft):
        chat = rec(0, out=11, end=0.5 + 10 * tpot)
        doc = rec(1, out=11, ttft=long_ttft, end=1 + long_ttft + 10 * tpot, kind="long")
        return [chat, doc]

    epyc = serve_elastic_rate.auto_rate(unloaded(0.04, 2.45))
    assert epyc == pytest.approx(serve_elastic_rate.RATE_X_LONG_TTFT / 2.45, abs=1e-3)  # not 0.035 / 0.04 = 0.875
    assert "document TTFT 2.45 s (the TPOT's: 0.875)" in serve_elastic_rate.rate_rule(unloaded(0.04, 2.45), epyc)
    xeon = serve_elastic_rate.auto_rate(unloaded(0.075, 3.0))  # the TPOT's rule binds: 0.467 < 1.5 / 3 = 0.5
    assert xeon == pytest.approx(serve_elastic_rate.RATE_X_TPOT / 0.075, abs=1e-3)
    assert "the unloaded TPOT 75 ms" in serve_elastic_rate.rate_rule(unloaded(0.075, 3.0), xeon)
