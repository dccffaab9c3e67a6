"""Backpressure against live node servers (real gRPC, Redis, tiny random model) and the router:
a node bounds its long calls and its engine's waiting queue, answering RESOURCE_EXHAUSTED with
a retry hint beyond them (HTTP 429 through the router), and its control calls still get through;
the index publisher folds its queue instead of growing it."""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import uuid

import grpc
import pytest

from engine.config import EngineConfig, SchedulerConfig
from protos.convert import sampling_to_proto
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc, serving_pb2
from tests.clusters import start_node, start_router
from tests.helpers import engine_config, prompt, wait_for
from tokens.sampling_params import SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)


def engine(model: str, max_num_seqs: int = 64) -> EngineConfig:
    return engine_config(model, num_blocks=512, scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))


def decode_call(stub, rid: str, n: int = 20):
    return stub.Decode(kv_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt(hash(rid) % 97, n),
                                            sampling=sampling_to_proto(LONG)), timeout=60)


def drain_quietly(stream) -> None:
    try:
        list(stream)
    except grpc.RpcError:
        pass  # cancelled by the test


def test_long_calls_beyond_the_limit_are_refused_and_control_calls_still_pass(redis_url, tiny_model):
    node = start_node("decode", "decode-0", engine(tiny_model), redis_url=redis_url,
                      namespace=f"bp-{uuid.uuid4().hex[:6]}", grpc_workers=4, max_streams=2)
    try:
        with grpc.insecure_channel(node.address) as ch:
            stub = kv_pb2_grpc.DecodeNodeStub(ch)
            streams = [decode_call(stub, f"s{i}") for i in range(2)]
            for s in streams:
                next(s)  # both running: every slot taken
            with pytest.raises(grpc.RpcError) as err:
                next(decode_call(stub, "over"))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_streams" in err.value.details()
            assert dict(err.value.trailing_metadata())["retry-after-ms"] == "200"
            # Control calls have their own threads: an abort gets through and frees a slot.
            assert stub.AbortDecode(serving_pb2.AbortRequest(request_id="s0"), timeout=5).found
            list(streams[0])
            assert wait_for(lambda: node.gate.inflight == 1)
            next(decode_call(stub, "now-fits"))
            assert node.stats()["refused_calls"] == 1
            for s in streams[1:]:
                s.cancel()
    finally:
        node.stop()


def test_a_full_waiting_queue_refuses_new_requests(redis_url, tiny_model):
    node = start_node("decode", "decode-0", engine(tiny_model, max_num_seqs=1), redis_url=redis_url,
                      namespace=f"bp-{uuid.uuid4().hex[:6]}", grpc_workers=8, max_waiting=1)
    try:
        with grpc.insecure_channel(node.address) as ch:
            stub = kv_pb2_grpc.DecodeNodeStub(ch)
            running = decode_call(stub, "run")
            next(running)
            waiting = decode_call(stub, "wait")
            threading.Thread(target=drain_quietly, args=(waiting,), daemon=True).start()
            assert wait_for(lambda: node.aengine.load.waiting == 1)
            with pytest.raises(grpc.RpcError) as err:
                next(decode_call(stub, "refused"))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_waiting 1" in err.value.details()
            assert dict(err.value.trailing_metadata())["retry-after-ms"] == "200"
            with pytest.raises(grpc.RpcError) as err:  # a reservation is a new request too
                kv_pb2_grpc.KVTransferStub(ch).ReserveBlocks(kv_pb2.ReserveBlocksRequest(
                    request_id="r", model_fingerprint=node.engine.fingerprint, block_size=16,
                    prompt_token_ids=prompt(3, 40)), timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            running.cancel()
            waiting.cancel()
    finally:
        node.stop()


def test_overloaded_node_is_http_429_with_a_retry_hint_through_the_router(redis_url, tiny_model):
    from engine.models.builtin import resolve_builtin

    ns = f"bp-{uuid.uuid4().hex[:6]}"
    node = start_node("decode", "decode-0", engine(tiny_model), redis_url=redis_url, namespace=ns,
                      grpc_workers=4, max_streams=1, lease_s=1.5, heartbeat_s=0.2)
    router = start_router(redis_url, resolve_builtin("smollm2-135m"), namespace=ns, http_port=0, max_model_len=1024,
                          short_prompt_tokens=1024, vocab_size=512, max_migrations=0)
    try:
        assert wait_for(lambda: router.orchestrator.refresher.view.has_decode)
        with grpc.insecure_channel(node.address) as ch:
            hold = decode_call(kv_pb2_grpc.DecodeNodeStub(ch), "hold")
            next(hold)  # the node's only long-call slot
            req = urllib.request.Request(
                f"http://{router.http_address}/v1/completions", headers={"Content-Type": "application/json"},
                data=json.dumps({"model": "m", "prompt": prompt(5, 20), "max_tokens": 4}).encode())
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=30)
            body = json.loads(err.value.read())
            assert err.value.code == 429 and body["error"]["type"] == "rate_limit_exceeded"
            assert err.value.headers["retry-after-ms"] == "200" and err.value.headers["Retry-After"] == "1"
            hold.cancel()
    finally:
        router.stop()
        node.stop()


def test_the_publisher_folds_its_queue_when_redis_cannot_keep_up():
    """Batches beyond max_batches are folded into one with the same net effect: the queue
    stays bounded, and what the index finally receives is what it would have been."""
    from kv_index.events import BlockRemoved, BlockStored, fold_kv_events
    from kv_index.nodes import NodeInfo
    from node.publisher import IndexPublisherThread

    class Unused:  # never started: only the queue is exercised
        info = NodeInfo("n", "decode", "127.0.0.1:1", "fp", 16, 64)

    pub = IndexPublisherThread(Unused(), dict, heartbeat_s=0.5, max_batches=8)
    batches = [[BlockStored((i, i + 1000), None, ())] + ([BlockRemoved((i - 1,))] if i % 2 else [])
               for i in range(100)]
    for b in batches:
        pub.submit_events(b)
        assert pub.queued_batches <= 9
    assert pub.num_coalesced > 0
    taken = pub._take_events(timeout=0)
    assert fold_kv_events(ev for b in taken for ev in b) == fold_kv_events(ev for b in batches for ev in b)
    for _ in range(1000):
        pub.submit_step(object())
    assert len(pub._steps) == 256
