"""Quiet node failures, against real Redis, real gRPC node servers (tiny random model on CPU,
in this process) and the router: a decode engine wedged in a step (its gRPC and its heartbeats
to Redis still alive), a node whose lease lapses while its engine runs, a failing engine step,
a prefill engine that hangs. Each is a real fault in the node's own process (the fault hooks
only that process can set: AsyncEngine.step_delay_s, NodeServer.set_step_fault, the
publisher stopped); the router finds it by the sign meant for it, the request moves, and the
client's tokens equal a run without the fault, none lost, none twice.

The decode node's heartbeats (contract: serving.proto Heartbeat) are checked on a node's own
Decode stream. The frozen process (SIGSTOP) is tests/test_freeze.py, on Ray actors.
"""
from __future__ import annotations

import time
import uuid

import grpc
import pytest

import pdserve
from tests import migration_harness
from tests.helpers import prompt, wait_for
from tests.migration_harness import DEADLINE_S, three_node_cluster

MAX_TOKENS = 24
# Tiny-model steps take milliseconds: a short progress deadline keeps the tests short.
FLOOR_S = 1.0
REQUESTS = migration_harness.requests()  # 0: disaggregated (>= 32 tokens), 1: prefilled on the decode node


@pytest.fixture(scope="module")
def reference(tiny_model):
    return migration_harness.reference_run(tiny_model, MAX_TOKENS)


@pytest.fixture
def cluster(redis_url, tok_dir, tiny_model):
    """prefill-0, decode-0, decode-1 and a router with a 1 s progress floor; per test."""
    yield from three_node_cluster(redis_url, tok_dir, tiny_model, prefix="gray", decode_progress_floor_s=FLOOR_S,
                                  decode_progress_ceiling_s=2 * FLOOR_S, prefill_deadline_factor=2.0,
                                  prefill_deadline_floor_s=FLOOR_S)


class Streams(migration_harness.Streams):
    requests, max_tokens = REQUESTS, MAX_TOKENS


def failures(router, reason: str) -> float:
    return router.orchestrator.metrics.registry.get_sample_value(
        "pdserve:router_node_failures_detected_total", {"model_name": "m", "reason": reason}) or 0.0


def busiest_decode(nodes):
    victim = max(("decode-0", "decode-1"), key=lambda n: nodes[n].aengine.load.running)
    assert nodes[victim].aengine.load.running > 0
    return nodes[victim]


def slow_decoders(nodes, seconds: float = 0.03) -> None:
    for nid in ("decode-0", "decode-1"):
        nodes[nid].aengine.step_delay_s = seconds  # the kill-or-wedge lands mid-stream every run


def test_a_wedged_decode_engine_is_given_up_on_and_its_late_tokens_never_reach_the_client(cluster, reference):
    router, nodes = cluster
    slow_decoders(nodes)
    streams = Streams(router.address)
    streams.wait_tokens(3)
    victim = busiest_decode(nodes)
    # Wedged: its loop sits in one step for 4 s. Its gRPC answers pings, its heartbeats to
    # Redis go on, so only the streams' silence (no token, no heartbeat) tells.
    victim.aengine.step_delay_s = 4.0
    wedged_at = time.monotonic()
    assert wait_for(lambda: failures(router, "progress_deadline") >= 1, timeout=15)
    detect_s = time.monotonic() - wedged_at
    victim.aengine.step_delay_s = 0.0  # it wakes: its step's tokens go to streams the router left
    streams.join()
    streams.assert_exact(reference)
    print(f"wedged decode engine detected in {detect_s:.2f} s (progress floor {FLOOR_S} s)")
    assert detect_s < 10 * FLOOR_S
    assert failures(router, "lease_lapsed") == 0 and failures(router, "keepalive") == 0


def test_a_nodes_lapsed_lease_moves_its_streams_in_flight(cluster, reference):
    router, nodes = cluster
    slow_decoders(nodes, 0.15)  # the streams outlast the 1.5 s lease
    streams = Streams(router.address)
    streams.wait_tokens(3)
    victim = busiest_decode(nodes)
    victim.publisher.stop(deregister=False)  # its heartbeats to Redis stop; its engine goes on
    streams.join()
    streams.assert_exact(reference)
    assert failures(router, "lease_lapsed") >= 1


def test_a_failed_engine_step_moves_its_requests_once(cluster, reference):
    router, nodes = cluster
    slow_decoders(nodes)
    streams = Streams(router.address)
    streams.wait_tokens(3)
    victim = busiest_decode(nodes)
    victim.set_step_fault(1)  # its next step raises inside the model: INTERNAL for its requests
    streams.join()
    streams.assert_exact(reference)
    assert failures(router, "step_error") >= 1
    assert victim.aengine.alive  # one failed step is not a dead node


def test_a_second_step_failure_ends_the_request_with_the_error(cluster):
    router, nodes = cluster
    for nid in ("decode-0", "decode-1"):
        nodes[nid].set_step_fault(-1)  # every step fails, on both nodes
    try:
        with pdserve.Client(router.address, timeout=DEADLINE_S, retries=0) as c:
            with pytest.raises(pdserve.PdServeError, match="engine step failed") as err:
                with c.generate(token_ids=prompt(2, 20), max_tokens=8, temperature=0.0) as stream:
                    list(stream)
        assert err.value.code == grpc.StatusCode.INTERNAL
        assert err.value.message.startswith("engine step failed:")  # the node's words, as the contract has them
    finally:
        for nid in ("decode-0", "decode-1"):
            nodes[nid].set_step_fault(0)
    assert failures(router, "step_error") == 2  # on the first node, then on the one it moved to
    assert router.orchestrator.metrics.registry.get_sample_value(
        "pdserve:request_migrations_total", {"model_name": "m", "reason": "gave_up"}) == 1


def test_a_hung_prefill_is_given_up_on_by_its_deadline_and_recomputed(cluster, reference):
    router, nodes = cluster
    nodes["prefill-0"].aengine.step_delay_s = 3.0  # its engine hangs in each step; its gRPC does not
    streams = Streams(router.address, range(1))  # the long prompt: disaggregated
    elapsed = streams.join()
    streams.assert_exact(reference)
    assert failures(router, "prefill_deadline") >= 1
    assert elapsed < 3.0  # the deadline (about FLOOR_S here), not the hung step, set the pace


def test_decode_heartbeats_come_only_while_the_engine_moves(cluster):
    """A node's own Decode stream (no router): with heartbeat_s asked for, silences are filled
    with heartbeats whose progress counter only grows; a step that takes long (a wedged
    engine) brings none; without heartbeat_s (an older router) there are none at all."""
    from protos.convert import sampling_to_proto
    from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
    from tokens.sampling_params import SamplingParams

    router, nodes = cluster
    node = nodes["decode-0"]
    for n in ("decode-0", "decode-1"):
        nodes[n].aengine.step_delay_s = 0.4
    sampling = sampling_to_proto(SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(node.address) as ch:
        stub = kv_pb2_grpc.DecodeNodeStub(ch)

        def decode(**kw) -> list[tuple[float, object]]:
            req = kv_pb2.DecodeRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt(5, 12),
                                       sampling=sampling, **kw)
            return [(time.monotonic(), m) for m in stub.Decode(req, timeout=30)]

        got = decode(heartbeat_s=0.05)
        plain = decode()
    with grpc.insecure_channel(router.address) as ch:  # through the router: heartbeats stop there
        from protos.pdserve.v1 import serving_pb2, serving_pb2_grpc

        relayed = list(serving_pb2_grpc.PdServeStub(ch).Generate(serving_pb2.GenerateRequest(
            tokens=serving_pb2.TokenPrompt(ids=prompt(5, 12)), sampling=sampling), timeout=30))
    assert {m.WhichOneof("kind") for m in relayed} == {"chunk", "complete"}
    kinds = [m.WhichOneof("kind") for _, m in got]
    beats = [m.heartbeat.engine_progress for _, m in got if m.WhichOneof("kind") == "heartbeat"]
    assert beats and beats == sorted(set(beats))  # only when the loop moved, never the same count twice
    # at most one per step (the loop moves once per 0.4 s step), not one per 0.05 s of silence
    assert len(beats) <= kinds.count("chunk") + 1
    gaps = [b[0] - a[0] for a, b in zip(got, got[1:])]
    assert max(gaps) >= 0.3  # during a long step the stream stays silent
    assert [m.WhichOneof("kind") for _, m in plain if m.WhichOneof("kind") == "heartbeat"] == []
    assert [m.chunk.token_ids for _, m in got if m.WhichOneof("kind") == "chunk"] == \
        [m.chunk.token_ids for _, m in plain if m.WhichOneof("kind") == "chunk"]


KEEPALIVE_SERVER = """
import sys
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2_grpc
from protos.conventions import keepalive_server_options
s = grpc.server(futures.ThreadPoolExecutor(2), options=keepalive_server_options(min_ping_interval_s=0.1))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), s)
print(s.add_insecure_port("127.0.0.1:0"), flush=True)
s.start()
s.wait_for_termination()
"""


def test_keepalive_finds_a_frozen_server_and_servers_accept_its_pings():
    """A real process (a gRPC health server) watched by a channel that pings every 0.2 s
    (protos/conventions.py, scaled down 10x): with keepalive_server_options the pings are
    accepted for as long as the stream lasts (gRPC's default policy closes a connection pinged
    every 2 s after 6 s, "too many pings"), and SIGSTOP of the server fails the stream
    UNAVAILABLE ("ping timeout") within time + timeout."""
    import asyncio
    import os
    import signal
    import subprocess
    import sys

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from protos.conventions import keepalive_ping_options
    from router.liveness import KEEPALIVE, call_failure
    from tests.helpers import REPO

    proc = subprocess.Popen([sys.executable, "-c", KEEPALIVE_SERVER], cwd=REPO, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})

    async def watch() -> tuple[grpc.aio.AioRpcError, float, float]:
        opts = keepalive_ping_options(time_s=0.2, timeout_s=0.3) + [("grpc.keepalive_permit_without_calls", 1)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
            await call.read()  # SERVING
            t0 = time.monotonic()
            read = asyncio.ensure_future(call.read())
            done, _ = await asyncio.wait({read}, timeout=2.0)  # ten pings' time
            if not done:
                os.kill(proc.pid, signal.SIGSTOP)
            frozen = time.monotonic()
            try:
                await asyncio.wait_for(read, timeout=10)
            except grpc.aio.AioRpcError as e:
                return e, frozen - t0, time.monotonic() - frozen
            raise AssertionError("the stream went on")

    try:
        port = int(proc.stdout.readline())
        err, lived_s, detect_s = asyncio.run(watch())
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert lived_s >= 2.0  # ten pings accepted
    assert call_failure(err.code(), err.details()) == KEEPALIVE, err.details()
    assert detect_s < 0.2 + 0.3 + 1.0  # time + timeout, and slack for a loaded machine
