"""`pdserve chaos` (chaos/): the judge on hand-built histories, the checks and the exit
code, the nemesis schedule, the router process's flags, the silent proxy and the freezer on
real loopback sockets and processes; then scenarios on the embedded cluster (real Redis, real
Ray actors frozen with SIGSTOP, a real router process SIGKILLed, real gRPC and HTTP) with a tiny
random-weight model that carries SmolLM2's tokenizer: nothing lost, nothing duplicated, outputs
equal the fault-free run; and the negative control, a router that moves nothing, must fail."""
from __future__ import annotations

import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from chaos.cli import summary
from chaos.cluster import parse_migrations
from chaos.context import Options
from chaos.faults import FREEZER
from chaos.history import Attempt, Expect, RequestLog, checks, exit_code, figures, judge, recovery_s
from chaos.nemesis import FAULTS, plan
from chaos.proxy import SilentProxy
from chaos.scenarios import ORDER, SCENARIOS, run_scenario
from chaos.workload import Batch, Endpoints, _read_sse, make_specs

REF = {"a": [1, 2, 3], "b": [4, 5]}


def done(tokens, t0=0.0, code=None, retryable=False, finish="length", message=""):
    a = Attempt(started=t0, tokens=list(tokens), times=[t0 + 1 + i for i in range(len(tokens))], ended=t0 + 9)
    if code is None:
        a.finish = finish
    else:
        a.code, a.retryable, a.message = code, retryable, message
    return a


# ----------------------------------------------------------------------------- the judge
def test_a_request_completed_once_with_the_reference_tokens_is_fine():
    v = judge(RequestLog("a", attempts=[done([1, 2, 3])]), REF["a"], failures_allowed=False)
    assert (v.outcome, v.identical, v.duplicated_tokens) == ("completed", True, 0)


def test_a_cut_stream_counts_as_lost_unless_the_retry_completes_it():
    cut = done([1, 2], code="UNAVAILABLE", retryable=True)
    assert judge(RequestLog("a", attempts=[cut], budget_spent=False), REF["a"], False).outcome == "lost"
    # today's rule, "a stream cut with 0 tokens counts as not lost", is gone: it is lost too
    assert judge(RequestLog("a", attempts=[done([], code="UNAVAILABLE", retryable=True)]), REF["a"], False).outcome \
        == "lost"
    retried = RequestLog("a", attempts=[cut, done([1, 2, 3], t0=10)])
    v = judge(retried, REF["a"], False)
    assert (v.outcome, v.identical, v.duplicated_tokens) == ("completed", True, 0)  # the cut's tokens thrown away


def test_lost_duplicated_and_different_tokens():
    assert judge(RequestLog("a", attempts=[done([1, 2])]), REF["a"], False).outcome == "lost"  # short
    v = judge(RequestLog("a", attempts=[done([1, 2, 3, 3])]), REF["a"], False)
    assert (v.outcome, v.duplicated_tokens, v.identical) == ("completed", 1, False)
    v = judge(RequestLog("a", attempts=[done([1, 2, 9])]), REF["a"], False)
    assert (v.outcome, v.identical) == ("completed", False)
    twice = judge(RequestLog("a", attempts=[done([1, 2, 3]), done([1, 2, 3], t0=10)]), REF["a"], False)
    assert twice.duplicated_tokens == 3  # a second completion: all its tokens twice
    hang = RequestLog("a", attempts=[Attempt(started=0.0, tokens=[1])])
    assert judge(hang, REF["a"], True).outcome == "lost"  # never ended
    assert judge(RequestLog("zz", attempts=[done([1])]), None, True).outcome == "lost"  # no reference


def test_a_typed_failure_after_the_budget_is_allowed_only_where_the_scenario_allows_it():
    refused = RequestLog("a", attempts=[done([], code="UNAVAILABLE", retryable=True)] * 3, budget_spent=True)
    assert judge(refused, REF["a"], failures_allowed=True).outcome == "failed"
    assert judge(refused, REF["a"], failures_allowed=False).outcome == "lost"
    early = RequestLog("a", attempts=[done([], code="UNAVAILABLE", retryable=True)], budget_spent=False)
    assert judge(early, REF["a"], True).outcome == "lost"  # gave up before its budget
    step = RequestLog("a", attempts=[done([1], code="INTERNAL", message="engine step failed: boom")])
    assert judge(step, REF["a"], True).outcome == "failed"  # the second step error ends it: typed
    bug = RequestLog("a", attempts=[done([1], code="INTERNAL", message="KeyError")])
    assert judge(bug, REF["a"], True).outcome == "lost"
    late = RequestLog("a", attempts=[done([], code="DEADLINE_EXCEEDED")])
    assert judge(late, REF["a"], True).outcome == "lost"  # the client's deadline: a hang


def test_figures_and_recovery_over_attempts():
    logs = [RequestLog("a", attempts=[done([1, 2, 3])]),
            RequestLog("b", attempts=[done([4], code="UNAVAILABLE", retryable=True), done([4, 5], t0=20)]),
            RequestLog("b", attempts=[done([4, 5, 5])])]
    assert figures(logs, REF) == {"requests": 3, "completed": 3, "failed": 0, "lost": 0, "duplicated_tokens": 1,
                                  "outputs_identical": False, "retried": 1}
    # the longest wait from the fault for a request's next token, whichever attempt brought it
    a = RequestLog("a", attempts=[Attempt(0.0, [1, 2], times=[1.0, 3.5], ended=4.0, finish="length")])
    b = RequestLog("b", attempts=[Attempt(0.0, [3], times=[1.5], ended=1.6, code="UNAVAILABLE", retryable=True),
                                  Attempt(5.0, [3], times=[6.0], ended=7.0, finish="length")])
    before = RequestLog("c", attempts=[Attempt(0.0, [4], times=[0.5], ended=0.6, finish="length")])
    assert recovery_s([a, b, before], fault_at=2.0) == 4.0


def test_checks_and_the_exit_code_see_every_figure():
    ok = {"requests": 2, "completed": 2, "lost": 0, "duplicated_tokens": 0, "outputs_identical": True,
          "placed_on_slow_node": 0, "restart_s": 3.1, "detect_s": 1.2}
    expect = (Expect("placed_on_slow_node", "==", 0), Expect("restart_s", "not_none"), Expect("detect_s", "<=", 5.0))
    assert all(checks(ok, expect).values())
    for field, bad in (("placed_on_slow_node", 1), ("restart_s", None), ("detect_s", 6.0), ("detect_s", None),
                       ("lost", 1), ("completed", 1)):
        c = checks({**ok, field: bad}, expect)
        assert not all(c.values()), field
        assert exit_code([{"checks": c}]) == 1
    assert exit_code([{"checks": checks(ok, expect)}]) == 0
    assert exit_code([]) == 1 and exit_code([{"scenario": "x"}]) == 1  # no result, no checks: not a pass
    assert not Expect("missing", "==", 0).holds(ok)
    assert not Expect("unavailable_s", "<=", 5).holds({"unavailable_s": None})  # absent is not within a bound
    assert checks({**ok, "completed": 1}, (), failures_allowed=True)["lost == 0"]  # failures allowed: no completed check
    rows = summary([{"scenario": "s", **ok, "checks": {"lost == 0": False}, "passed": False}])
    assert rows["passed"] is False and rows["scenarios"][0]["failed_checks"] == ["lost == 0"]


def test_every_scenario_is_registered_and_checked():
    assert sorted(ORDER) == sorted(SCENARIOS)
    assert {"freeze-decode", "freeze-prefill", "partition", "redis-hang", "step-error", "all-decode-down",
            "restart-router", "restart-router-replicas"} <= set(SCENARIOS)
    opts = Options()
    for name in ("freeze-decode", "freeze-prefill", "partition"):
        assert Expect("detect_s", "<=", 5.0) in SCENARIOS[name].expect(opts)
    assert Expect("restart_s", "not_none") in SCENARIOS["kill-decode"].expect(opts)
    assert Expect("restart_s", "not_none") not in SCENARIOS["kill-decode"].expect(Options(restart_timeout_s=0))
    assert Expect("placed_on_slow_node", "==", 0) in SCENARIOS["slow-node"].expect(opts)
    assert set(FAULTS) <= set(SCENARIOS)
    shaped = SCENARIOS["slow-node"].shape(make_specs(8, 10, "s"))  # the first wave streams longer
    assert [s.max_tokens for s in shaped] == [40] * 4 + [10] * 4


def test_requests_are_greedy_and_seeded_over_grpc_and_http():
    specs = make_specs(8, 16, "salt", http_every=2)
    assert len({s.key for s in specs}) == 8
    kinds = [(dict(s.sampling).get("seed") is not None, s.protocol) for s in specs]
    assert kinds[:4] == [(False, "grpc"), (True, "grpc"), (False, "http"), (True, "http")] == kinds[4:]
    sampled = dict(specs[1].sampling)
    assert sampled["temperature"] == 0.8 and sampled["top_p"] == 0.95
    assert all(s.messages[0][1].startswith("Chaos run salt") for s in specs)  # no cache from other runs
    from chaos.context import Run

    for n, every in ((8, 2), (8, 4), (4, 2)):  # each half of a split batch: gRPC and HTTP both
        halves = Run(None, Options(requests=n), make_specs(n, 16, "s", http_every=every)).halves()
        assert all({s.protocol for s in h} == {"grpc", "http"} for h in halves), (n, every)
        assert sorted(s.key for h in halves for s in h) == sorted(s.key for s in make_specs(n, 16, "s", every))


def test_the_http_stream_is_read_token_by_token():
    def sse(*events):
        return io.BytesIO(b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
                                   for e in events))

    tok = {"choices": [{"logprobs": {"content": [{"token": "Hi"}, {"token": "!"}]}, "finish_reason": None}]}
    end = {"choices": [{"logprobs": None, "finish_reason": "length"}]}
    a = Attempt(0.0)
    _read_sse(sse(tok, end, b"[DONE]"), a)
    assert (a.tokens, a.finish, a.code) == (["Hi", "!"], "length", None)
    cut = Attempt(0.0)
    _read_sse(sse(tok), cut)  # no [DONE]: the stream was cut
    assert (cut.tokens, cut.code, cut.retryable) == (["Hi", "!"], "UNAVAILABLE", True)
    err = Attempt(0.0)
    _read_sse(sse(tok, {"error": {"code": "unavailable", "message": "node gone"}}), err)
    assert err.code == "UNAVAILABLE" and err.retryable


def test_the_nemesis_plans_one_fault_at_a_time_within_its_time():
    a, b = plan(random.Random(7), 120.0), plan(random.Random(7), 120.0)
    assert a == b and len(a) >= len(FAULTS)  # the seed repeats the schedule
    for ev, nxt in zip(a, a[1:]):
        assert ev.at_s + ev.hold_s < nxt.at_s  # never two at once
    assert a[-1].at_s + a[-1].hold_s <= 120.0
    assert {ev.fault for ev in a[: len(FAULTS)]} == set(FAULTS)  # every kind before any twice
    with pytest.raises(ValueError):
        plan(random.Random(0), 10.0, faults=())


def test_migrations_are_read_from_a_metrics_page():
    page = ('# HELP pdserve:request_migrations_total ...\n'
            'pdserve:request_migrations_total{model_name="m",reason="decode_failed"} 3.0\n'
            'pdserve:request_migrations_total{model_name="m",reason="gave_up"} 1.0\n'
            'pdserve:requests_total{model_name="m"} 9.0\n')
    assert parse_migrations(page) == {"decode_failed": 3.0, "gave_up": 1.0}


def test_the_router_process_gets_the_routers_flags_and_no_password_on_its_command_line():
    from deploy.router_process import router_argv
    from frontend.server import build_parser
    from router.config import RouterConfig

    cfg = RouterConfig(redis_url="redis://:s3cr%2Ft@127.0.0.1:6390/0", model_name="m", tokenizer_dir="/tok",
                       max_model_len=512, namespace="ns", short_prompt_tokens=16, max_migrations=3,
                       straggler_factor=2.5, max_tokens_limit=100)
    argv, env = router_argv(cfg, port=5001, http_port=None)
    assert argv[1:3] == ["-m", "frontend.server"] and "s3cr" not in " ".join(argv)
    assert env == {"PDSERVE_REDIS_PASSWORD": "s3cr/t"}
    a = build_parser().parse_args(argv[3:])
    assert (a.redis_url, a.port, a.http_port, a.namespace, a.short_prompt_tokens, a.max_migrations,
            a.straggler_factor, a.max_tokens_limit) == ("redis://127.0.0.1:6390/0", 5001, -1, "ns", 16, 3, 2.5, 100)


# ----------------------------------------------------------------------------- real sockets, processes
def _echo_server():
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    import threading

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_the_proxy_forwards_goes_silent_without_closing_and_resumes():
    srv = _echo_server()
    with SilentProxy(f"127.0.0.1:{srv.getsockname()[1]}") as proxy:
        c = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        c.sendall(b"one")
        assert c.recv(16) == b"one"
        proxy.silence()
        c.sendall(b"two")
        c.settimeout(0.5)
        with pytest.raises(socket.timeout):  # nothing arrives, and nothing closes
            c.recv(16)
        proxy.resume()
        c.settimeout(5)
        assert c.recv(16) == b"two"  # what was held goes through once the partition heals
        assert proxy.forwarded_bytes >= 9  # (the echo of "two" may still be counting)
        c.close()
    srv.close()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_the_freezer_stops_and_always_continues_a_real_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        FREEZER.freeze(proc.pid)
        time.sleep(0.1)
        assert _state(proc.pid) == "T" and proc.pid in FREEZER.stopped
        assert proc.pid in FREEZER.thaw_all()  # what every run's finally does
        time.sleep(0.1)
        assert _state(proc.pid) != "T" and not FREEZER.stopped
    finally:
        FREEZER.thaw(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_a_batch_reports_an_unreachable_router_as_lost():
    from chaos.workload import RetryBudget

    b = Batch(Endpoints("127.0.0.1:1", "127.0.0.1:1", timeout_s=5, sdk_retry_budget_s=0.5),
              make_specs(2, 4, "x", http_every=1), RetryBudget(attempts=2, seconds=2, base_s=0.05), timeout_s=30)
    logs = b.join()
    assert all(log.last.code == "UNAVAILABLE" and log.budget_spent for log in logs)
    assert figures(logs, {log.key: [1] for log in logs})["lost"] == 2


# ----------------------------------------------------------------------------- on a cluster
STEP_DELAY_S = 0.03  # decode steps of the tiny model are too fast for a fault to land mid-way


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from chaos.cluster import ChaosCluster
    from deploy.launcher import ClusterConfig
    from engine.config import CacheConfig, EngineConfig
    from engine.models.tiny import save_tiny_chat_model

    # SmolLM2's vocabulary, so the router and the decode nodes tokenize chat prompts for real.
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "chat", seed=2)
    config = ClusterConfig(engine=EngineConfig(model=str(model), dtype="float32", cache=CacheConfig(num_blocks=256)),
                           prefill_nodes=1, decode_nodes=2, grpc_port=0, http_port=0, dashboard_port=0,
                           namespace="chaos-test", lease_s=2.0)
    with ChaosCluster(config) as c:
        yield c


def check(result: dict, scenario: str) -> None:
    print(json.dumps(result))
    assert result["scenario"] == scenario
    failed = [k for k, v in result["checks"].items() if not v]
    assert not failed, (failed, result)


# Bounds in the suite have slack for a busy shared machine; `pdserve chaos` measures the real
# figure against the 5 s bound (docs/benchmarks.md, chaos).
SUITE = dict(requests=4, max_tokens=24, step_delay_s=STEP_DELAY_S, detect_bound_s=15.0, freeze_s=6.0,
             partition_s=6.0)


def test_freeze_decode(cluster):
    result = run_scenario(cluster, "freeze-decode", Options(**SUITE))
    check(result, "freeze-decode")
    assert result["migrations"]["gave_up"] == 0


def test_partition(cluster):
    result = run_scenario(cluster, "partition", Options(**SUITE))
    check(result, "partition")
    assert result["migrations"]["gave_up"] == 0


def test_corrupt_kv_on_every_transport(cluster):
    result = run_scenario(cluster, "corrupt-kv", Options(**{**SUITE, "max_tokens": 8}))
    check(result, "corrupt-kv")
    assert min(result["damaged_shm"], result["damaged_tcp"], result["damaged_grpc"]) >= 1, result


@pytest.mark.skipif(not os.environ.get("PDSERVE_HOST_LOSS_E2E"), reason=(
    "opt-in (PDSERVE_HOST_LOSS_E2E=1, about 30 s): CI's 20 minutes; tests/test_host_loss.py kills a real "
    "setsid process tree in CI, and `pdserve chaos --scenario host-loss` runs it on SmolLM2"))
def test_host_loss(cluster):
    """A raylet per decode node joins the cluster's Ray as another host; the busiest node's host
    (raylet, agents, the node's worker) is SIGKILLed mid-stream."""
    result = run_scenario(cluster, "host-loss", Options(**SUITE))
    check(result, "host-loss")
    assert result["requests"] == result["completed"] and result["killed_processes"] >= 2, result
    assert result["migrations"]["gave_up"] == 0


def test_restart_router(cluster):
    result = run_scenario(cluster, "restart-router", Options(**SUITE))
    check(result, "restart-router")
    assert result["requests"] == result["completed"]  # the cut ones too, by the client's retry


def test_restart_router_replicas(cluster):
    """Two router replicas on one port, the busier one SIGKILLed mid-stream: the clients' retries
    land on the other; nothing lost, outputs identical (greedy and seeded)."""
    result = run_scenario(cluster, "restart-router-replicas", Options(**SUITE))
    check(result, "restart-router-replicas")
    assert result["requests"] == result["completed"] and result["outputs_identical"], result


def test_all_decode_down(cluster):
    cluster.settle()  # the router process of restart-router is gone, every node registered again
    result = run_scenario(cluster, "all-decode-down", Options(**SUITE))
    check(result, "all-decode-down")
    assert result["unavailable_s"] is not None and result["sent_after_restart"] >= 1, result


def test_a_router_that_moves_nothing_fails_the_checks(cluster):
    """The negative control: freeze-decode against a router started with ``--max-migrations 0``
    (a production setting: nothing moves off a failed node) and clients that do not retry must
    come out failed, the frozen node's streams lost and nothing detected; if it passed, the
    checks above would be blind. (With the clients' retries on, the retries complete the cut
    streams and only ``detect_s`` fails.)"""
    from chaos.workload import RetryBudget

    cluster.settle()  # nothing left out of placement after the restarts above
    with cluster.router_process(max_migrations=0):
        result = run_scenario(cluster, "freeze-decode", Options(**SUITE, budget=RetryBudget(attempts=1)))
    print(json.dumps(result))
    failed = {k for k, v in result["checks"].items() if not v}
    assert result["passed"] is False
    assert {"lost == 0", "completed == requests", "detect_s <= 15.0"} <= failed, result
    assert result["lost"] >= 1 and result["migrations"]["gave_up"] >= 1 and result["detect_s"] is None, result
