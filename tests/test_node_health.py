"""A failing engine step (issue 26, part 2): the step's requests fail with INTERNAL and the node
serves on; K failing steps in a row, or an engine thread that died, make the node unhealthy
(NOT_SERVING over grpc.health.v1, out of the index in Redis, its reason in its health record and
on /metrics). Faults are real: an exception raised inside the model's forward pass
(node/faults.py). The crash-loop back-off runs on a real local Ray: a node that cannot start
is retried with a wait, then stays down with its reason; an unhealthy node is restarted."""
from __future__ import annotations

import time
import urllib.request
import uuid

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_index.health import DOWN, SERVING, UNHEALTHY, HealthStore
from kv_index.nodes import Role
from kv_index.reader import IndexReader
from node.engine_thread import AsyncEngine, EngineStoppedError, RequestFailedError
from node.faults import InjectedStepError
from node.health import StartPolicy, StepHealth
from node.start_guard import NodeDownError, StartGuard
from protos.convert import sampling_to_proto
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc, serving_pb2
from tests.helpers import node_engine_config, wait_for
from tokens.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
PROMPT = list(range(20, 37))


# ---------------------------------------------------------------------- pure logic
def test_step_health_counts_failures_in_a_row_and_a_good_step_resets():
    h = StepHealth(3)
    err = RuntimeError("boom")
    assert h.failed(err) is None and h.failed(err) is None
    h.succeeded()
    assert (h.consecutive, h.failed_steps, h.good_steps) == (0, 2, 1)
    assert h.failed(err) is None and h.failed(err) is None
    reason = h.failed(err)
    assert reason is not None and "3 times in a row" in reason and "boom" in reason
    assert StepHealth(0).failed(err) is None  # 0: never unhealthy
    with pytest.raises(ValueError):
        StepHealth(-1)


def test_start_policy_backs_off_then_gives_up():
    p = StartPolicy(max_failures=4, backoff_s=1.0, backoff_max_s=3.0)
    assert [p.delay_s(n) for n in range(5)] == [0.0, 1.0, 2.0, 3.0, 3.0]
    assert [p.gives_up(n) for n in range(5)] == [False, False, False, False, True]
    with pytest.raises(ValueError):
        StartPolicy(max_failures=0)


def test_start_guard_counts_failed_lives_in_real_redis(redis_url):
    """The guard's record across lives (each life a new guard, as each is a new process)."""
    r = redis.Redis.from_url(redis_url)
    store = HealthStore(r, f"guard-{uuid.uuid4().hex[:6]}")
    waits: list[float] = []
    policy = StartPolicy(max_failures=3, backoff_s=1.0, backoff_max_s=30.0)

    def life(reconstructed=True) -> StartGuard:
        return StartGuard(store, "decode-0", policy, reconstructed=reconstructed, sleep=waits.append)

    g = life(reconstructed=False)
    g.before_start()
    assert store.read("decode-0").failures == 1  # counted before it starts: a crash counts
    assert not g.start_failed(FileNotFoundError("/models/x"))
    g = life()
    g.before_start()  # waits 1 s, starts, works, then its engine fails
    g.started()
    assert (store.read("decode-0").state, store.read("decode-0").failures) == (SERVING, 1)
    assert not g.unhealthy("engine step failed 3 times in a row")
    rec = store.read("decode-0")
    assert (rec.state, rec.failures, rec.restarts) == (UNHEALTHY, 2, 2)
    g = life()
    g.before_start()  # waits 2 s; this life dies while loading (nothing recorded)
    g = life()
    with pytest.raises(NodeDownError, match="3 failed starts"):
        g.before_start()
    rec = store.read("decode-0")
    assert (rec.state, rec.failures) == (DOWN, 3) and "died while starting" in rec.reason
    assert waits == [1.0, 2.0]
    assert set(store.read_all()) == {"decode-0"}
    g.clear()
    assert store.read_all() == {}

    # A good step forgives earlier failures; a serving life killed by Ray is a restart, not a failure.
    g = life(reconstructed=False)
    store.write("decode-0", UNHEALTHY, "x", failures=2, restarts=2)
    g.before_start()
    g.started()
    assert g.pending
    g.proven()
    g = life()
    g.before_start()
    rec = store.read("decode-0")
    assert (rec.failures, rec.restarts) == (1, 3) and "died while serving" in rec.reason
    r.close()


# ---------------------------------------------------------------------- the engine thread
def test_injected_step_errors_fail_requests_then_k_in_a_row_make_the_engine_unhealthy(tiny_dir):
    from engine.engine import LLMEngine

    told: list[str] = []
    ae = AsyncEngine(LLMEngine(node_engine_config(tiny_dir), load_tokenizer=False), max_step_failures=2,
                     on_unhealthy=told.append)
    try:
        free = ae.run(lambda e: e.kv.num_free_blocks)
        ae.set_step_fault(1)
        with pytest.raises(RequestFailedError, match="engine step failed: InjectedStepError"):
            ae.add_request(PROMPT, GREEDY, request_id="a").result(timeout=30)
        assert (ae.health.consecutive, ae.num_step_errors) == (1, 1)
        assert ae.run(lambda e: e.kv.num_free_blocks) == free  # the half-done step's blocks came back
        assert len(ae.add_request(PROMPT, GREEDY, request_id="b").result(timeout=30).outputs[0].token_ids) == 6
        assert ae.health.consecutive == 0  # a good step in between resets the count

        assert ae.set_step_fault(-1) == 1  # every step, until cleared
        for rid in ("c", "d"):
            with pytest.raises((RequestFailedError, EngineStoppedError)):
                ae.add_request(PROMPT, GREEDY, request_id=rid).result(timeout=30)
        assert wait_for(lambda: told, 10)
        assert "2 times in a row" in told[0] and "InjectedStepError" in told[0]
        assert ae.unhealthy_reason == told[0] and not ae.alive
        with pytest.raises(EngineStoppedError, match="unhealthy: engine step failed 2 times"):
            ae.add_request(PROMPT, GREEDY, request_id="e")
    finally:
        ae.shutdown()


# ---------------------------------------------------------------------- a node in-process
def _decode(address: str, rid: str, max_tokens: int = 6):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    ch = grpc.insecure_channel(address)
    return ch, kv_pb2_grpc.DecodeNodeStub(ch).Decode(kv_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=PROMPT, sampling=sampling_to_proto(params)), timeout=30)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def _metric(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture()
def node_ns():
    return f"health-{uuid.uuid4().hex[:6]}"


def test_a_failing_step_ends_decode_streams_with_internal_then_the_node_leaves_the_index(tiny_dir, redis_url,
                                                                                         node_ns):
    from tests.clusters import start_node

    server = start_node(Role.DECODE, "decode-0", node_engine_config(tiny_dir), redis_url=redis_url,
                        namespace=node_ns, lease_s=2.0, heartbeat_s=0.2, max_step_failures=2)
    r = redis.Redis.from_url(redis_url)
    reader = IndexReader(r, node_ns)
    try:
        assert "decode-0" in reader.live_nodes() and _health(server.address) == health_pb2.HealthCheckResponse.SERVING
        server.set_step_fault(-1)
        for n in (1, 2):  # contract 1: an in-stream INTERNAL error, then Complete(ERROR)
            ch, stream = _decode(server.address, f"r{n}")
            msgs = list(stream)
            ch.close()
            kinds = [m.WhichOneof("kind") for m in msgs]
            assert kinds == ["error", "complete"], kinds
            assert msgs[0].error.code == grpc.StatusCode.INTERNAL.value[0]
            assert msgs[0].error.message.startswith("engine step failed:")
            assert msgs[1].complete.finish_reason == serving_pb2.FINISH_REASON_ERROR
        # Two in a row: NOT_SERVING, out of the index, the reason recorded and refused with.
        assert wait_for(lambda: _health(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
        assert wait_for(lambda: "decode-0" not in reader.live_nodes(), 10)
        rec = HealthStore(r, node_ns).read("decode-0")
        assert rec.state == UNHEALTHY and "2 times in a row" in rec.reason
        assert server.stats()["healthy"] is False and server.health_reason == rec.reason
        ch, stream = _decode(server.address, "r3")
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        ch.close()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "unhealthy" in err.value.details()
        assert _metric(server.metrics_address, "pdserve:engine_step_failures_total") == 2
        assert _metric(server.metrics_address, "pdserve:node_healthy") == 0
        from deploy.status import gather  # `pdserve status` says why, though the node left the registry

        report, _ = gather(r, node_ns)
        assert report["pools"] == {} and [h["state"] for h in report["health"]] == [UNHEALTHY]
        assert any(e.startswith("decode-0: unhealthy") and "2 times in a row" in e for e in report["errors"])
    finally:
        server.stop()
        r.close()


def test_an_engine_thread_that_dies_ends_open_streams_with_unavailable(tiny_dir, redis_url, node_ns):
    from tests.clusters import start_node

    server = start_node(Role.DECODE, "decode-1", node_engine_config(tiny_dir), redis_url=redis_url,
                        namespace=node_ns, lease_s=2.0, heartbeat_s=0.2)
    r = redis.Redis.from_url(redis_url)
    try:
        server.aengine.step_delay_s = 0.05  # long enough to kill the loop mid-stream
        ch, stream = _decode(server.address, "long", max_tokens=200)
        first = next(stream)
        assert first.WhichOneof("kind") == "chunk"
        server.set_step_fault(1, fatal=True)  # the loop thread dies of it
        rest = list(stream)
        ch.close()
        errors = [m.error for m in rest if m.WhichOneof("kind") == "error"]
        assert [e.code for e in errors] == [grpc.StatusCode.UNAVAILABLE.value[0]]
        assert "engine loop died" in errors[0].message
        assert rest[-1].complete.finish_reason == serving_pb2.FINISH_REASON_ERROR
        assert wait_for(lambda: _health(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
        assert wait_for(lambda: "decode-1" not in IndexReader(r, node_ns).live_nodes(), 10)
        assert "engine loop died" in HealthStore(r, node_ns).read("decode-1").reason
    finally:
        server.stop()
        r.close()


def test_a_failing_prefill_step_fails_the_prefill_call_with_internal(tiny_dir, redis_url, node_ns):
    from tests.clusters import start_node

    server = start_node(Role.PREFILL, "prefill-0", node_engine_config(tiny_dir), redis_url=redis_url,
                        namespace=node_ns, lease_s=2.0, heartbeat_s=0.2)
    try:
        server.set_step_fault(1)
        with grpc.insecure_channel(server.address) as ch:
            stub = kv_pb2_grpc.PrefillNodeStub(ch)
            req = kv_pb2.PrefillRequest(request_id="p1", prompt_token_ids=PROMPT, sampling=sampling_to_proto(GREEDY))
            with pytest.raises(grpc.RpcError) as err:
                stub.Prefill(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "engine step failed" in err.value.details() and InjectedStepError.__name__ in err.value.details()
            req.request_id = "p2"  # one failed step: the node serves on
            assert stub.Prefill(req, timeout=30).first_token_ids
        assert server.stats()["healthy"] is True
    finally:
        server.stop()


# ---------------------------------------------------------------------- Ray: restart, crash loop
def _wait_dead(actor, timeout: float) -> str:
    ray = pytest.importorskip("ray")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(actor.address.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.RayActorError as e:
            return str(e)
        except ray.exceptions.GetTimeoutError:
            break
    raise AssertionError(f"actor still not dead after {timeout}s")


def test_a_node_that_cannot_start_is_retried_with_a_back_off_then_stays_down(tmp_path, redis_url, local_ray):
    ray = pytest.importorskip("ray")
    from deploy.nodes import NodeSupervisor, NodeTemplate, Plan, server_builder
    from deploy.status import gather, render
    from node.actor import spawn_node
    from node.config import NodeConfig

    ns = f"loop-{uuid.uuid4().hex[:6]}"
    missing = tmp_path / "no-such-model"
    cfg = NodeConfig(node_id="decode-0", role="decode", redis_url=redis_url, namespace=ns, load_tokenizer=False,
                     engine=node_engine_config(missing), max_start_failures=2)
    t0 = time.monotonic()
    actor = spawn_node(cfg, server_builder(Role.DECODE), num_cpus=0)
    why = _wait_dead(actor, 90)
    took = time.monotonic() - t0
    assert "stays down after 2 failed starts" in why
    rec = HealthStore(redis.Redis.from_url(redis_url), ns).read("decode-0")
    assert (rec.state, rec.failures, rec.restarts) == (DOWN, 2, 2)
    assert "no-such-model" in rec.reason
    assert took >= StartPolicy().delay_s(1)  # the second try waited its back-off
    assert "decode-0" not in ray.util.list_named_actors()

    # `pdserve nodes` leaves it down (no spawn every pass) until a new supervisor starts.
    sup = NodeSupervisor(NodeTemplate(engine=cfg.engine, redis_url=redis_url, namespace=ns),
                         {Role.PREFILL: 0, Role.DECODE: 1})
    assert sup.step()[Role.DECODE] == Plan((), ())
    assert "decode-0" not in ray.util.list_named_actors()
    report, _ = gather(redis.Redis.from_url(redis_url), ns)
    assert [h["state"] for h in report["health"]] == [DOWN]
    assert any("decode-0: down after 2 failed start(s)" in e and "no-such-model" in e for e in report["errors"])
    assert "no-such-model" in render(report)
    assert sup.reset_down() == ["decode-0"]


def test_an_unhealthy_node_actor_is_restarted_by_ray(tiny_dir, redis_url, local_ray):
    ray = pytest.importorskip("ray")
    from deploy.nodes import server_builder
    from node.actor import spawn_node
    from node.config import NodeConfig

    ns = f"restart-{uuid.uuid4().hex[:6]}"
    cfg = NodeConfig(node_id="decode-1", role="decode", redis_url=redis_url, namespace=ns, load_tokenizer=False,
                     lease_s=2.0, heartbeat_s=0.2, engine=node_engine_config(tiny_dir), max_step_failures=1)
    actor = spawn_node(cfg, server_builder(Role.DECODE), num_cpus=0)
    try:
        stats = ray.get(actor.stats.remote(), timeout=90)
        ray.get(actor.set_step_fault.remote(-1), timeout=30)
        ch, stream = _decode(stats["address"], "x")
        msgs = list(stream)
        ch.close()
        assert msgs[0].error.code == grpc.StatusCode.INTERNAL.value[0]

        def restarted() -> dict | None:
            try:
                s = ray.get(actor.stats.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                return None
            return s if s["pid"] != stats["pid"] else None

        assert wait_for(restarted, 90, every=0.5)
        new = restarted()
        assert new["healthy"] and new["step_failures"] == 0  # a fresh process: the fault is gone
        rec = HealthStore(redis.Redis.from_url(redis_url), ns).read("decode-1")
        assert (rec.state, rec.failures, rec.restarts) == (SERVING, 1, 1)
        assert "engine step failed 1 times in a row" in rec.reason
    finally:
        ray.get(actor.stop.remote(drain_timeout_s=1.0), timeout=30)
        ray.kill(actor, no_restart=True)


def test_failure_flags_reach_the_node_configs():
    import argparse

    from deploy import nodes
    from deploy.cli import _add_engine_args, add_up_arguments, cluster_config_from_args, engine_config_from_args

    up = argparse.ArgumentParser()
    add_up_arguments(up)
    cfg = cluster_config_from_args(up.parse_args(["--max-step-failures", "5", "--max-start-failures", "2"]))
    assert (cfg.max_step_failures, cfg.max_start_failures) == (5, 2)
    p = argparse.ArgumentParser()
    _add_engine_args(p)
    nodes.add_arguments(p)
    a = p.parse_args(["--redis-url", "redis://r:6379/0", "--max-step-failures", "0", "--max-start-failures", "4"])
    node = nodes.template_from_args(a, engine_config_from_args(a), {}).config(Role.DECODE, 0)
    assert (node.max_step_failures, node.max_start_failures) == (0, 4)
    from node.config import NodeConfig

    with pytest.raises(ValueError, match="max_start_failures"):
        NodeConfig(node_id="d", role="decode", redis_url="redis://r", max_start_failures=0)
