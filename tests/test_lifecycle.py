"""Lifecycle against a live small cluster (real Redis, real gRPC, in-process prefill and decode
node servers on a tiny random model, the router): every way a request can end early (Abort,
the client going away, its deadline) reaches both nodes and gives back every KV block, read
from the nodes' pool counts."""
from __future__ import annotations

import http.client
import json
import threading
import uuid

import pytest

import pdserve
from tests.clusters import start_node, start_router
from tests.helpers import engine_config, prompt, wait_for

BLOCKS = 256


@pytest.fixture(scope="module")
def cluster(redis_url, tok_dir, tiny_model):
    ns = f"life-{uuid.uuid4().hex[:6]}"
    eng = engine_config(tiny_model, num_blocks=BLOCKS)
    nodes = {role: start_node(role, f"{role}-0", eng, redis_url=redis_url, namespace=ns, lease_s=1.5,
                              heartbeat_s=0.2, grpc_workers=16, reservation_lease_s=2.0)
             for role in ("prefill", "decode")}
    router = start_router(redis_url, tok_dir, namespace=ns, http_port=0, max_model_len=1024, short_prompt_tokens=32,
                          vocab_size=512)
    assert wait_for(lambda: len(router.orchestrator.refresher.view.nodes) == 2)
    yield {"router": router, "nodes": nodes}
    router.stop()
    for s in nodes.values():
        s.stop()


def all_blocks_free(nodes) -> bool:
    """Every pool back at its starting count (free includes evictable cached blocks), no
    reservation left, nothing running or waiting."""
    for node in nodes.values():
        s = node.stats()
        if s["free_blocks"] != s["num_blocks"] or s["running"] or s["waiting"] or s.get("reservations"):
            return False
    return True


def assert_pools_return(nodes) -> None:
    assert wait_for(lambda: all_blocks_free(nodes)), {n: node.stats() for n, node in nodes.items()}


LONG = dict(max_tokens=900, temperature=0.0, ignore_eos=True)


def test_abort_mid_stream_frees_every_block(cluster):
    assert_pools_return(cluster["nodes"])
    before = cluster["nodes"]["prefill"].num_prefills
    with pdserve.Client(cluster["router"].address, timeout=60) as c:
        stream = c.generate(token_ids=prompt(1, 100), request_id="life-abort", **LONG)  # disaggregated
        got, aborted = 0, False
        for ch in stream:
            got += len(ch.token_ids)
            if got >= 2 and not aborted:
                aborted = c.abort("life-abort")
                assert aborted
        assert stream.completion.finish_reason == "abort" and got < 900
    assert cluster["nodes"]["prefill"].num_prefills == before + 1
    assert_pools_return(cluster["nodes"])


@pytest.mark.parametrize("tokens", [20, 100], ids=["decode-only", "disaggregated"])
def test_client_going_away_frees_every_block(cluster, tokens):
    with pdserve.Client(cluster["router"].address, timeout=60) as c:
        with c.generate(token_ids=prompt(2, tokens), **LONG) as stream:
            it = iter(stream)
            next(it)
            next(it)
        # leaving the with block cancelled the call
    assert_pools_return(cluster["nodes"])


@pytest.mark.parametrize("deadline_s", [0.02, 0.1, 0.3, 1.0])
def test_a_deadline_anywhere_in_the_request_frees_every_block(cluster, deadline_s):
    """The deadline lands in placement, reservation, prefill, transfer or decode depending on
    its length; wherever it lands, both pools come back."""
    with pdserve.Client(cluster["router"].address, retries=0) as c:
        with pytest.raises(pdserve.DeadlineExceededError):
            c.complete(token_ids=prompt(3, 200), timeout=deadline_s, **{**LONG, "max_tokens": 800})
    assert_pools_return(cluster["nodes"])


def test_http_client_disconnect_mid_stream_frees_every_block(cluster):
    host, port = cluster["router"].http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": "m", "prompt": prompt(4, 100), "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read1(64)  # streaming has begun (read1: one chunk, whatever its framing)
    conn.sock.close()  # the client vanishes mid-stream
    conn.close()
    assert_pools_return(cluster["nodes"])


def test_many_cancelled_streams_leave_nothing_behind(cluster):
    """A burst of streams, each ended early a different way, concurrently."""
    errors: list[BaseException] = []
    params = {**LONG, "max_tokens": 300}

    def one(i: int) -> None:
        try:
            with pdserve.Client(cluster["router"].address, retries=0) as c:
                if i % 3 == 0:
                    with pytest.raises(pdserve.DeadlineExceededError):
                        c.complete(token_ids=prompt(10 + i, 40 + 10 * i), timeout=0.05 * (i + 1), **params)
                    return
                with c.generate(token_ids=prompt(10 + i, 40 + 10 * i), request_id=f"burst-{i}", **params) as s:
                    for n, _ in enumerate(s):
                        if n == i % 4:
                            if i % 3 == 1:
                                c.abort(f"burst-{i}")
                            else:
                                break
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert_pools_return(cluster["nodes"])


def test_pushed_kv_never_collected_is_freed_after_the_lease(cluster):
    """A router that reserves, has the prefill node push, then never calls Decode (it died):
    the decode node's reaper frees the blocks once the lease (2 s here) runs out."""
    import grpc

    from protos.convert import sampling_to_proto
    from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
    from tokens.sampling_params import SamplingParams

    dec, pre = cluster["nodes"]["decode"], cluster["nodes"]["prefill"]
    ids = prompt(5, 80)
    with grpc.insecure_channel(dec.address) as dch, grpc.insecure_channel(pre.address) as pch:
        res = kv_pb2_grpc.KVTransferStub(dch).ReserveBlocks(kv_pb2.ReserveBlocksRequest(
            request_id="orphan", model_fingerprint=dec.engine.fingerprint, block_size=16, prompt_token_ids=ids),
            timeout=10)
        out = kv_pb2_grpc.PrefillNodeStub(pch).Prefill(kv_pb2.PrefillRequest(
            request_id="orphan", prompt_token_ids=ids, sampling=sampling_to_proto(SamplingParams(max_tokens=4)),
            decode_address=dec.address, reservation=res), timeout=30)
    assert out.blocks_sent == len(res.block_ids) > 0
    assert dec.stats()["reservations"] == 1 and dec.stats()["free_blocks"] < BLOCKS
    assert_pools_return(cluster["nodes"])


# ------------------------------------------------------------------ drain
def _reader(redis_url: str, ns: str):
    import redis

    from kv_index.reader import IndexReader

    return IndexReader(redis.Redis.from_url(redis_url), ns)


class StreamInThread:
    """One long greedy stream through the router on a thread; ``started`` once a chunk came."""

    def __init__(self, address: str, ids: list[int], max_tokens: int) -> None:
        self.started = threading.Event()
        self.tokens: list[int] = []
        self.completion = None
        self.error: BaseException | None = None
        self._args = address, ids, max_tokens
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        address, ids, max_tokens = self._args
        try:
            with pdserve.Client(address, timeout=120, retries=0) as c:
                stream = c.generate(token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                for ch in stream:
                    self.tokens += ch.token_ids
                    self.started.set()
                self.completion = stream.completion
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e
        finally:
            self.started.set()

    def join(self) -> None:
        self.thread.join(120)
        assert not self.thread.is_alive()


def test_drain_finishes_in_flight_requests_then_leaves(redis_url, tok_dir, tiny_model):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc

    ns = f"drain-{uuid.uuid4().hex[:6]}"
    eng = engine_config(tiny_model)
    nodes = {role: start_node(role, f"{role}-0", eng, redis_url=redis_url, namespace=ns, lease_s=1.5,
                              heartbeat_s=0.2, grpc_workers=8) for role in ("prefill", "decode")}
    router = start_router(redis_url, tok_dir, namespace=ns, max_model_len=1024, short_prompt_tokens=32, vocab_size=512)
    reader = _reader(redis_url, ns)
    try:
        assert wait_for(lambda: len(router.orchestrator.refresher.view.nodes) == 2)
        dec = nodes["decode"]
        s = StreamInThread(router.address, prompt(7, 100), 900)  # disaggregated: both nodes take part
        assert s.started.wait(60) and s.error is None
        result: list[bool] = []
        drainer = threading.Thread(target=lambda: result.append(dec.drain(timeout_s=60)))
        drainer.start()
        assert wait_for(lambda: dec.draining)
        with grpc.insecure_channel(dec.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:  # no new request gets in
                kv_pb2_grpc.KVTransferStub(ch).ReserveBlocks(kv_pb2.ReserveBlocksRequest(
                    request_id="late", model_fingerprint=dec.engine.fingerprint, block_size=16,
                    prompt_token_ids=prompt(8, 40)), timeout=5)
        if dec.gate.inflight:  # still streaming: routers already skip it
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
            assert dict(err.value.trailing_metadata())["retry-after-ms"] == "500"
        assert wait_for(lambda: "decode-0" not in {n.node_id for n in router.orchestrator.refresher.view.nodes})
        s.join()
        assert s.error is None, s.error
        assert s.completion.finish_reason == "length" and len(s.tokens) == 900
        drainer.join(60)
        assert result == [True]
        assert "decode-0" not in reader.live_nodes()
        # An idle node drains at once.
        assert nodes["prefill"].drain(timeout_s=5) is True
        assert reader.live_nodes() == {}
    finally:
        router.stop()
        for n in nodes.values():
            n.stop()


def test_drain_gives_up_after_its_timeout(redis_url, tiny_model):
    ns = f"drain-{uuid.uuid4().hex[:6]}"
    dec = start_node("decode", "decode-0", engine_config(tiny_model), redis_url=redis_url, namespace=ns,
                     lease_s=1.5, heartbeat_s=0.2, grpc_workers=4, reservation_lease_s=60)
    try:
        import grpc

        from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc

        with grpc.insecure_channel(dec.address) as ch:  # a reservation nobody will ever collect
            kv_pb2_grpc.KVTransferStub(ch).ReserveBlocks(kv_pb2.ReserveBlocksRequest(
                request_id="held", model_fingerprint=dec.engine.fingerprint, block_size=16,
                prompt_token_ids=prompt(9, 40)), timeout=5)
        assert dec.drain(timeout_s=0.3) is False
        assert _reader(redis_url, ns).live_nodes() == {}
    finally:
        dec.stop()


def _actor_and_router(prefix: str, redis_url: str, tok_dir: str, tiny_model: str):
    """A decode node actor on the local Ray (as `pdserve up` and `pdserve nodes` run it) and a
    router in this process, in a fresh namespace: (namespace, actor, its pid, router)."""
    import ray

    from deploy.nodes import server_builder
    from kv_index.nodes import Role
    from node.actor import spawn_node
    from node.config import NodeConfig

    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cfg = NodeConfig(node_id="decode-0", role="decode", redis_url=redis_url, namespace=ns, lease_s=1.5,
                     heartbeat_s=0.2, load_tokenizer=False, grpc_workers=8, engine=engine_config(tiny_model))
    actor = spawn_node(cfg, server_builder(Role.DECODE), num_cpus=0)
    pid = ray.get(actor.stats.remote(), timeout=120)["pid"]
    router = start_router(redis_url, tok_dir, namespace=ns, max_model_len=1024, short_prompt_tokens=1024,
                          vocab_size=512)
    return ns, actor, pid, router


def test_sigterm_drains_a_node_actor(redis_url, tok_dir, tiny_model, local_ray):
    """What `pdserve up` and `pdserve nodes` run: a node actor. SIGTERM mid-stream: the stream
    completes, the node leaves the index, the process exits and Ray does not restart it."""
    import os
    import signal

    import ray

    ns, actor, pid, router = _actor_and_router("sigterm", redis_url, tok_dir, tiny_model)
    reader = _reader(redis_url, ns)
    try:
        assert wait_for(lambda: router.orchestrator.refresher.view.has_decode, timeout=30)
        s = StreamInThread(router.address, prompt(11, 20), 900)
        assert s.started.wait(60) and s.error is None
        os.kill(pid, signal.SIGTERM)
        s.join()
        assert s.error is None, s.error
        assert s.completion.finish_reason == "length" and len(s.tokens) == 900

        def exited() -> bool:
            try:
                os.kill(pid, 0)
                return False
            except ProcessLookupError:
                return True

        assert wait_for(exited, timeout=60)
        assert reader.live_nodes() == {}
        with pytest.raises(ray.exceptions.RayActorError):  # an intended exit: not restarted
            ray.get(actor.ready.remote(), timeout=30)
    finally:
        router.stop()
        ray.kill(actor, no_restart=True)


def test_pod_prestop_drains_the_node_actor_below_it(redis_url, tok_dir, tiny_model, local_ray):
    """The Helm worker preStop (`python -m deploy.pod_drain`): Kubernetes' SIGTERM reaches only
    the pod's PID 1 (`ray start`), never the actor process, so the hook finds the node actor by
    its Ray process title and signals it. Mid-stream: the stream completes, the hook returns once
    the node left the index and exited, and Ray does not restart it."""
    import os
    import subprocess
    import sys

    import ray

    from deploy.pod_drain import node_actor_pids, process_table

    ns, actor, pid, router = _actor_and_router("prestop", redis_url, tok_dir, tiny_model)
    try:
        # Found by its title among this test's processes (the local Ray runs below this one).
        assert node_actor_pids(process_table(), under=os.getpid()) == [pid]
        assert wait_for(lambda: router.orchestrator.refresher.view.has_decode, timeout=30)
        s = StreamInThread(router.address, prompt(12, 20), 900)
        assert s.started.wait(60) and s.error is None
        hook = subprocess.run([sys.executable, "-m", "deploy.pod_drain", "--timeout-s", "90",
                               "--under", str(os.getpid())], capture_output=True, text=True, timeout=120)
        assert hook.returncode == 0, hook.stdout + hook.stderr
        assert f"SIGTERM to node actor process {pid}" in hook.stdout and "1 node(s) drained" in hook.stdout
        s.join()
        assert s.error is None, s.error
        assert s.completion.finish_reason == "length" and len(s.tokens) == 900
        assert _reader(redis_url, ns).live_nodes() == {}
        with pytest.raises(ray.exceptions.RayActorError):  # an intended exit: not restarted
            ray.get(actor.ready.remote(), timeout=30)
    finally:
        router.stop()
        ray.kill(actor, no_restart=True)


def test_router_drain_finishes_its_streams_and_refuses_new_ones(cluster, redis_url, tok_dir):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ns = cluster["nodes"]["decode"].config.namespace
    router = start_router(redis_url, tok_dir, namespace=ns, max_model_len=1024, short_prompt_tokens=32, vocab_size=512)
    try:
        assert wait_for(lambda: router.orchestrator.refresher.view.has_decode)
        s = StreamInThread(router.address, prompt(12, 100), 900)
        assert s.started.wait(60) and s.error is None
        result: list[bool] = []
        drainer = threading.Thread(target=lambda: result.append(router.drain(timeout_s=60)))
        drainer.start()
        assert wait_for(lambda: router.orchestrator.draining)
        if router.orchestrator.inflight:  # still streaming: a newcomer is sent elsewhere
            with pdserve.Client(router.address, retries=0) as c:
                with pytest.raises(pdserve.UnavailableError, match="draining"):
                    c.complete(token_ids=prompt(13, 20), max_tokens=2)
            with grpc.insecure_channel(router.address) as ch:
                stub = health_pb2_grpc.HealthStub(ch)

                def not_serving() -> bool:
                    try:
                        return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                            health_pb2.HealthCheckResponse.NOT_SERVING
                    except grpc.RpcError:
                        return True  # already stopped: the stream finished meanwhile
                assert wait_for(not_serving)
        s.join()
        assert s.error is None, s.error
        assert s.completion.finish_reason == "length" and len(s.tokens) == 900
        drainer.join(60)
        assert result == [True]
    finally:
        router.stop()
    assert_pools_return(cluster["nodes"])
