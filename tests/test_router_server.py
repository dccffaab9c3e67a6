"""The router server against a real Redis and real prefill/decode node servers (tiny random
model on CPU), driven through the pdserve SDK."""
from __future__ import annotations

import subprocess
import sys
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import pdserve
from tests.clusters import start_node, start_router
from tests.helpers import engine_config, prompt, wait_for

MAX_LEN = 512


@pytest.fixture(scope="module")
def bare_router(redis_url, tok_dir):
    """A router whose namespace has no nodes."""
    server = start_router(redis_url, tok_dir, namespace=f"bare-{uuid.uuid4().hex[:6]}", max_model_len=MAX_LEN,
                          http_port=0, max_tokens_limit=100)
    yield server
    server.stop()


def test_router_and_sdk_import_no_torch_or_ray():
    code = ("import sys, frontend.server, pdserve; bad = [m for m in ('torch', 'ray') if m in sys.modules]; "
            "print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_validation_errors_name_the_limits(bare_router):
    with pdserve.Client(bare_router.address, retries=0) as c:
        with pytest.raises(pdserve.InvalidRequestError,
                           match=r"maximum context length is 512 tokens .* \(max_prompt_tokens\); the prompt has 600"):
            c.complete(token_ids=[5] * 600)
        with pytest.raises(pdserve.InvalidRequestError, match=r"prompt \(500 tokens\) \+ max_tokens \(50\).*512"):
            c.complete(token_ids=[5] * 500, max_tokens=50)
        with pytest.raises(pdserve.InvalidRequestError, match="max_tokens is 101; max_tokens_limit is 100"):
            c.complete("hi", max_tokens=101)
        with pytest.raises(pdserve.InvalidRequestError, match="empty"):
            c.complete("")
        with pytest.raises(pdserve.InvalidRequestError, match="top_p"):
            c.complete("hi", top_p=1.5)
        with pytest.raises(pdserve.InvalidRequestError, match=r"token ids must be in \[0, 49152\)"):
            c.complete(token_ids=[10**6])
        with pytest.raises(pdserve.NotFoundError, match="'other'.*served models: \\['m'\\]"):
            c.complete("hi", model="other")


def test_no_live_nodes_is_unavailable(bare_router):
    with pdserve.Client(bare_router.address, retries=1, backoff=(0.01, 0.02)) as c:
        with pytest.raises(pdserve.UnavailableError, match="no live decode node"):
            c.complete("hello")
        assert c.health() is False


def test_http_without_nodes_is_503_with_a_retry_hint_and_not_ready(bare_router):
    import json
    import urllib.error
    import urllib.request

    base = f"http://{bare_router.http_address}"
    with urllib.request.urlopen(f"{base}/health", timeout=10) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{base}/ready", timeout=10)
    assert e.value.code == 503 and "no live decode node" in json.loads(e.value.read())["reason"]
    req = urllib.request.Request(f"{base}/v1/chat/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode())
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    body = json.loads(e.value.read())
    assert e.value.code == 503 and int(e.value.headers["Retry-After"]) >= 1
    assert body["error"]["type"] == "service_unavailable" and "decode node" in body["error"]["message"]
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'pdserve:requests_rejected_total{model_name="m",reason="unavailable"}' in text


def test_list_models_health_and_reflection(bare_router):
    with pdserve.Client(bare_router.address) as c:
        assert c.models() == [pdserve.ModelInfo("m", MAX_LEN)]
        assert c.abort("nope") is False
    with grpc.insecure_channel(bare_router.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for a in answers for s in a.list_services_response.service}
        assert "pdserve.v1.PdServe" in names and "grpc.health.v1.Health" in names


# ------------------------------------------------------------------ with real nodes
@pytest.fixture(scope="module")
def cluster(redis_url, tok_dir, tiny_model):
    ns = f"cl-{uuid.uuid4().hex[:6]}"
    eng = engine_config(tiny_model, num_blocks=256)

    def node(node_id, role):
        return start_node(role, node_id, eng, redis_url=redis_url, namespace=ns, lease_s=1.5, heartbeat_s=0.2,
                          grpc_workers=8)

    nodes = {"dec": node("dec", "decode"), "pre-a": node("pre-a", "prefill"), "pre-b": node("pre-b", "prefill")}
    router = start_router(redis_url, tok_dir, namespace=ns, max_model_len=MAX_LEN, http_port=0, short_prompt_tokens=32,
                          vocab_size=512)
    with pdserve.Client(router.address) as c:
        wait_for(c.health, timeout=10, every=0.1)
    yield {"router": router, "nodes": nodes, "model": tiny_model, "ns": ns, "redis_url": redis_url}
    router.stop()
    for s in nodes.values():
        s.stop()


@pytest.fixture(scope="module")
def reference(cluster):
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from tokens.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=cluster["model"], device="cpu", num_threads=1), load_tokenizer=False)

    def greedy(ids, max_tokens):
        out = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return tuple(out[0].outputs[0].token_ids)

    return greedy


def test_greedy_through_router_equals_single_engine(cluster, reference):
    nodes = cluster["nodes"]
    prefills = lambda: nodes["pre-a"].num_prefills + nodes["pre-b"].num_prefills  # noqa: E731
    with pdserve.Client(cluster["router"].address, timeout=60) as c:
        for ids, disaggregated in ((prompt(1, 100), True), (prompt(2, 20), False)):  # short_prompt_tokens=32
            before = prefills()
            done = c.complete(token_ids=ids, max_tokens=8, temperature=0.0, ignore_eos=True)
            assert prefills() == before + disaggregated
            assert (done.timings.prefill_s > 0) == disaggregated
            assert done.token_ids == reference(ids, 8)
            assert done.finish_reason == "length"
            assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == 8
            assert done.timings.total_s >= done.timings.first_token_s > 0
        # the first token ends it: completed by the router without a decode slot
        ids = prompt(3, 64)
        done = c.complete(token_ids=ids, max_tokens=1, temperature=0.0, ignore_eos=True)
        assert done.token_ids == reference(ids, 1) and done.finish_reason == "length"


def _wait_for_blocks(cluster, ids, node_id, blocks):
    import redis

    from kv_index.reader import IndexReader
    from tokens.block_hash import hash_prompt_blocks

    fp = cluster["nodes"][node_id].engine.fingerprint
    reader = IndexReader(redis.Redis.from_url(cluster["redis_url"]), cluster["ns"])
    hashes = hash_prompt_blocks(ids, 16, fp.encode())
    deadline = time.monotonic() + 10
    while reader.match(hashes, [node_id])[node_id].blocks < blocks:
        assert time.monotonic() < deadline, "prefix blocks never appeared in the index"
        time.sleep(0.05)
    # The warm-up must also be gone from the node's reported load (heartbeats lag by up to
    # heartbeat_s), or placement rightly sees a busy node and sends the request elsewhere.
    while True:
        info = reader.live_nodes()[node_id]
        if info.waiting == 0 and info.running == 0:
            break
        assert time.monotonic() < deadline, "node never reported idle"
        time.sleep(0.05)


def test_repeated_prefix_goes_to_the_prefill_node_holding_it(cluster, reference):
    from tokens.sampling_params import SamplingParams

    nodes = cluster["nodes"]
    shared = prompt(4, 96)  # 6 full blocks
    # Warm pre-b only (pre-a would win an empty-cache tie by id), straight on its engine.
    list(nodes["pre-b"].aengine.add_request(shared + [7], SamplingParams(max_tokens=1, temperature=0.0)))
    _wait_for_blocks(cluster, shared, "pre-b", 6)
    before = nodes["pre-b"].num_prefills, nodes["pre-a"].num_prefills
    ids = shared + prompt(5, 20)
    with pdserve.Client(cluster["router"].address, timeout=60) as c:
        done = c.complete(token_ids=ids, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert nodes["pre-b"].num_prefills == before[0] + 1 and nodes["pre-a"].num_prefills == before[1]
    assert done.usage.cached_prompt_tokens == 96
    assert done.token_ids == reference(ids, 4)


def test_abort_stops_a_running_request(cluster):
    with pdserve.Client(cluster["router"].address, timeout=60) as c:
        stream = c.generate(token_ids=prompt(6, 40), max_tokens=400, temperature=0.0, ignore_eos=True,
                            request_id="to-abort")
        got = 0
        for ch in stream:
            got += len(ch.token_ids)
            if got == 1:
                assert c.abort("to-abort") is True
        assert stream.completion.finish_reason == "abort"
        assert got < 400


def test_overload_is_resource_exhausted_with_retry_hint(redis_url, tok_dir):
    """A registered decode node whose socket never answers holds one request in flight
    (deterministically, unlike a real generation that may finish first)."""
    import socket
    import threading

    import redis

    from kv_index.nodes import NodeInfo
    from kv_index.publisher import NodePublisher

    ns = f"busy-{uuid.uuid4().hex[:6]}"
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connects complete in the kernel; nothing ever speaks HTTP/2
        info = NodeInfo("stuck", "decode", f"127.0.0.1:{silent.getsockname()[1]}", "fp", 16, 64)
        NodePublisher(redis.Redis.from_url(redis_url), info, ns, lease_s=30).register()
        router = start_router(redis_url, tok_dir, namespace=ns, max_model_len=MAX_LEN, http_port=0, max_inflight=1)
        try:
            with pdserve.Client(router.address, retries=0) as c:
                holder = threading.Thread(target=lambda: pytest.raises(pdserve.PdServeError, c.complete,
                                                                       "hold", timeout=3))
                holder.start()
                deadline = time.monotonic() + 3
                while True:
                    try:
                        c.complete("second", timeout=0.2)
                    except pdserve.ResourceExhaustedError as e:
                        assert "max_inflight 1" in e.message and e.retry_after_s == pytest.approx(0.2)
                        break
                    except pdserve.DeadlineExceededError:
                        pass  # the holder had not been admitted yet; this one took the slot
                    assert time.monotonic() < deadline, "never saw RESOURCE_EXHAUSTED"
                holder.join()
        finally:
            router.stop()


def test_prefill_node_down_falls_back_to_decode(cluster, reference):
    nodes = cluster["nodes"]
    # Both prefillers gone without deregistering: the view still lists them until their lease
    # lapses, so the router tries one, fails, releases the reservation and recomputes.
    nodes["pre-a"].stop(deregister=False)
    nodes["pre-b"].stop(deregister=False)
    ids = prompt(9, 80)
    with pdserve.Client(cluster["router"].address, timeout=60) as c:
        done = c.complete(token_ids=ids, max_tokens=6, temperature=0.0, ignore_eos=True)
        assert done.token_ids == reference(ids, 6)
        # after the lease (1.5 s) + refresh the dead nodes are out of the view: local prefill
        time.sleep(2.0)
        done = c.complete(token_ids=ids, max_tokens=6, temperature=0.0, ignore_eos=True)
        assert done.token_ids == reference(ids, 6)


def test_a_queued_prefill_keeps_renewing_its_reservation():
    """While the Prefill call waits (a busy prefill node's queue), the router renews the decode
    node's reservation every third of its lease; once the call returns it stops."""
    import asyncio

    from protos.pdserve.v1 import kv_pb2
    from router.node_client import await_renewing

    renewed: list[float] = []

    async def renew():
        renewed.append(asyncio.get_running_loop().time())

    async def slow_prefill():
        await asyncio.sleep(0.75)
        return kv_pb2.PrefillResponse(blocks_sent=3)

    async def run():
        t0 = asyncio.get_running_loop().time()
        resp = await await_renewing(slow_prefill(), renew, 0.3)
        n = len(renewed)
        await asyncio.sleep(0.25)
        return resp, t0, n

    resp, t0, n = asyncio.run(run())
    assert resp.blocks_sent == 3
    assert n == len(renewed) >= 3  # about every 0.1 s while the call waited (7 on an idle machine), none after
    assert renewed[0] - t0 < 0.3  # the first well within the first lease
