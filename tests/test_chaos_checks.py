"""The checks of `pdserve chaos` that make a run fail when it tested nothing or missed a fault
(chaos/history.py, chaos/scenarios.py, chaos/nemesis.py): hand-built results and histories,
each check once where it must fail and once where it holds. Pure: no cluster."""
from __future__ import annotations

from chaos.context import Options
from chaos.history import Attempt, Expect, Figure, RequestLog, checks, completed_once, exit_code, figures
from chaos.nemesis import FAULTS, MIN_COMPLETED_SHARE, NEMESIS_EXPECTATIONS, completed_share, tally, verdict
from chaos.scenarios import SCENARIOS

REF = {"a": [1, 2, 3], "b": [4, 5]}
# What every result carries when nothing went wrong (history.figures' fields).
FINE = {"requests": 8, "completed": 8, "failed": 0, "lost": 0, "duplicated_tokens": 0, "outputs_identical": True}


def ended(tokens, code=None, t0=0.0):
    a = Attempt(started=t0, tokens=list(tokens), times=[t0 + 1] * len(tokens), ended=t0 + 2)
    if code is None:
        a.finish = "length"
    else:
        a.code, a.retryable = code, True
    return a


def failed_checks(result: dict, expect, failures_allowed: bool = False) -> set[str]:
    return {k for k, v in checks(result, expect, failures_allowed).items() if not v}


# ----------------------------------------------------------------------------- nothing completed
def test_outputs_are_not_identical_when_nothing_completed():
    refused = [RequestLog(k, attempts=[ended([], "UNAVAILABLE")] * 2, budget_spent=True) for k in REF]
    f = figures(refused, REF, failures_allowed=True)
    assert (f["completed"], f["failed"], f["lost"], f["outputs_identical"]) == (0, 2, 0, False)
    c = checks(f, (), failures_allowed=True)  # typed failures allowed: only outputs_identical fails
    assert {k for k, v in c.items() if not v} == {"outputs_identical == True"}
    assert exit_code([{"checks": c}]) == 1
    one = figures([RequestLog("a", attempts=[ended([1, 2, 3])]), *refused[1:]], REF, failures_allowed=True)
    assert (one["completed"], one["outputs_identical"]) == (1, True)
    assert figures([], REF)["outputs_identical"] is False  # nothing sent: nothing compared


def test_an_expectation_may_compare_two_figures():
    e = Expect("refused", "==", Figure("damaged"))
    assert e.name == "refused == damaged"
    assert e.holds({"refused": 3, "damaged": 3})
    assert not e.holds({"refused": 1, "damaged": 3})
    assert not e.holds({"refused": 3}) and not e.holds({"refused": 3, "damaged": None})  # missing: fails
    assert Expect("a", "<=", Figure("b")).holds({"a": 1, "b": 2}) and not Expect("a", ">=", Figure("b")).holds(
        {"a": 1, "b": 2})
    assert not Expect("x", "<=", 5).holds({"x": None})  # None fails a bound (no "none passes" op)


# ----------------------------------------------------------------------------- corrupt-kv
def corrupt(refused, damaged=(8, 8, 8)):
    shm, tcp, grpc = damaged
    return {**FINE, "transfers_refused": refused, "transfers_damaged": sum(damaged), "damaged_shm": shm,
            "damaged_tcp": tcp, "damaged_grpc": grpc}


def test_corrupt_kv_needs_every_damaged_transfer_refused():
    expect = SCENARIOS["corrupt-kv"].expect(Options())
    assert not failed_checks(corrupt(24), expect)
    assert failed_checks(corrupt(1), expect) == {"transfers_refused == transfers_damaged"}  # 23 accepted
    assert failed_checks(corrupt(25), expect) == {"transfers_refused == transfers_damaged"}  # a false refusal
    assert "damaged_tcp >= 1" in failed_checks(corrupt(16, (8, 0, 8)), expect)  # a transport never damaged
    no_sum = corrupt(24)
    del no_sum["transfers_damaged"]
    assert "transfers_refused == transfers_damaged" in failed_checks(no_sum, expect)


# ----------------------------------------------------------------------------- all-decode-down
def down(**over):
    return {**FINE, "requests": 12, "completed": 12, "probe_unavailable_s": 0.01, "unavailable_s": 12.9,
            "restart_s": 30.3, "sent_after_restart": 4, "completed_after_restart": 4, **over}


def test_all_decode_down_needs_its_failures_timed_and_the_requests_after_the_restart_completed():
    sc = SCENARIOS["all-decode-down"]
    expect = sc.expect(Options())
    assert not failed_checks(down(), expect, sc.failures_allowed)
    assert failed_checks(down(unavailable_s=None), expect, True) == {"unavailable_s <= 15.0"}  # absent: fails
    assert failed_checks(down(unavailable_s=15.5), expect, True) == {"unavailable_s <= 15.0"}
    assert failed_checks(down(completed_after_restart=3), expect, True) == {
        "completed_after_restart == sent_after_restart"}
    # nodes never back: nothing sent after, restart_s missing, both fail
    assert failed_checks(down(restart_s=None, sent_after_restart=0, completed_after_restart=0), expect, True) == {
        "restart_s not_none", "sent_after_restart >= 1"}
    # a run that does not wait for Ray's restart has no "after" to check
    no_wait = sc.expect(Options(restart_timeout_s=0))
    assert not failed_checks(down(sent_after_restart=0, completed_after_restart=0, restart_s=None), no_wait, True)


def test_completed_once_is_one_finished_attempt_and_the_last():
    cut = ended([1], "UNAVAILABLE")
    assert completed_once(RequestLog("a", attempts=[cut, ended([1, 2, 3])]))
    assert not completed_once(RequestLog("a", attempts=[cut, cut]))  # refused, budget spent
    assert not completed_once(RequestLog("a", attempts=[ended([1, 2, 3]), ended([1, 2, 3])]))  # twice
    assert not completed_once(RequestLog("a", attempts=[ended([1, 2, 3]), cut]))  # an attempt after it
    assert not completed_once(RequestLog("a"))


# ----------------------------------------------------------------------------- the nemesis
RECORDS = [{"fault": f, "victim": "x", "at_s": 3.0 * i} for i, f in enumerate(FAULTS)]


def test_tally_counts_each_kind_and_each_injection_that_raised():
    t = tally([*RECORDS, {"fault": "slow-node"}, {"fault": "partition", "error": "ValueError: no proxies"}], FAULTS)
    assert t["injected"] == {**{f: 1 for f in FAULTS}, "slow-node": 2}
    assert t["injection_failures"] == {"partition": 1} and t["faults_missing"] == []
    short = tally([{"fault": "redis-hang"}, {"fault": "kill-decode", "error": "RuntimeError: x"}], FAULTS)
    assert short["faults_missing"] == [f for f in FAULTS if f != "redis-hang"]  # in FAULTS' order
    assert tally([], ("partition",)) == {"injected": {}, "injection_failures": {}, "faults_missing": ["partition"]}


def nemesis(records=RECORDS, faults=FAULTS, **figs) -> dict:
    return verdict({**tally(records, faults), **FINE, "requests": 100, "completed": 100, "nodes_back": True, **figs})


def test_the_nemesis_passes_only_when_every_fault_went_in_and_enough_completed():
    assert MIN_COMPLETED_SHARE == 0.5 and Expect("completed_share", ">=", 0.5) in NEMESIS_EXPECTATIONS
    ok = nemesis()
    assert ok["passed"] and ok["completed_share"] == 1.0 and ok["injected"] == {f: 1 for f in FAULTS}

    def failed(r):
        return {k for k, v in r["checks"].items() if not v}

    raised = nemesis([*RECORDS, {"fault": "redis-hang", "error": "ValueError: no redis-server"}])
    assert not raised["passed"] and failed(raised) == {"injection_failures == {}"}
    missing = nemesis([r for r in RECORDS if r["fault"] != "restart-router"])
    assert failed(missing) == {"faults_missing == []"} and missing["faults_missing"] == ["restart-router"]
    assert nemesis(failed=50, completed=50)["passed"]  # half completed: the bound itself
    few = nemesis(failed=51, completed=49)
    assert failed(few) == {"completed_share >= 0.5"} and few["completed_share"] == 0.49
    none = nemesis(failed=100, completed=0, outputs_identical=False)
    assert failed(none) == {"completed_share >= 0.5", "outputs_identical == True"}
    silent = nemesis(requests=0, completed=0, outputs_identical=False)
    assert silent["completed_share"] is None and "completed_share >= 0.5" in failed(silent)
    assert failed(nemesis(nodes_back=False)) == {"nodes_back == True"}
    assert completed_share({"requests": 3, "completed": 2}) == 0.667
