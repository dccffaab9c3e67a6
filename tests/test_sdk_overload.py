"""The SDK against a real router overloaded through its own bound: a router with
``max_inflight=1`` (real gRPC, Redis, an in-process decode node with a tiny random model) whose
only slot a slowed stream holds. A request refused with RESOURCE_EXHAUSTED before any output is
retried after the router's hint and completes once the slot frees; while the slot stays taken,
the call gives up when its retry budget is spent and says so. Nothing here waits on a clock:
the holder stays in flight until the test cancels it (its 900 slowed steps would take minutes)."""
from __future__ import annotations

import re
import threading
import uuid

import grpc
import pytest

import pdserve
from protos.pdserve.v1 import serving_pb2 as pb
from protos.pdserve.v1 import serving_pb2_grpc as pb_grpc
from tests.clusters import start_node, start_router
from tests.helpers import prompt, wait_for
from tests.test_backpressure import engine


@pytest.fixture(scope="module")
def full_router(redis_url, tiny_model, tok_dir):
    """(router, holder): the router's one admission slot taken by a running stream."""
    ns = f"ovl-{uuid.uuid4().hex[:6]}"
    node = start_node("decode", "decode-0", engine(tiny_model), redis_url=redis_url, namespace=ns, grpc_workers=8)
    node.aengine.step_delay_s = 0.2  # fault hook of `pdserve chaos` slow-node: the holder outlives the test
    router = start_router(redis_url, tok_dir, namespace=ns, max_model_len=1024, short_prompt_tokens=1024,
                          vocab_size=512, max_migrations=0, max_inflight=1)
    channel = grpc.insecure_channel(router.address)
    try:
        assert wait_for(lambda: router.orchestrator.refresher.view.has_decode)
        holder = pb_grpc.PdServeStub(channel).Generate(pb.GenerateRequest(
            request_id="holder", tokens=pb.TokenPrompt(ids=prompt(1, 20)),
            sampling=pb.SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)), timeout=600)
        next(holder)  # admitted and streaming: inflight 1 = max_inflight
        yield router, holder
        holder.cancel()
    finally:
        channel.close()
        router.stop()
        node.aengine.step_delay_s = 0.0
        node.stop()


def test_overload_budget_spent_names_budget_and_status(full_router):
    router, _ = full_router
    with pdserve.Client(router.address, backoff=(0.01, 0.05), retry_budget_s=0.5, timeout=60) as c:
        with pytest.raises(pdserve.ResourceExhaustedError) as e:
            c.complete(token_ids=prompt(2, 20), max_tokens=2)
    msg = str(e.value)
    assert "max_inflight 1" in msg and "retry_budget_s=0.5" in msg and "last status RESOURCE_EXHAUSTED" in msg
    # The router's hint is 200 ms and the budget 0.5 s: the call was retried before giving up.
    assert int(re.search(r"(\d+) attempt\(s\)", msg).group(1)) >= 2
    assert e.value.retry_after_s == pytest.approx(0.2) and e.value.retryable


def test_overloaded_request_is_retried_and_completes_once_a_slot_frees(full_router):
    """Runs last in this module: it frees the slot by cancelling the holder."""
    router, holder = full_router
    with pdserve.Client(router.address, backoff=(0.01, 0.05), retry_budget_s=120, timeout=180) as c:
        stream = c.generate(token_ids=prompt(3, 20), max_tokens=4, temperature=0.0, ignore_eos=True)
        out: list = []
        t = threading.Thread(target=lambda: out.append([tok for ch in stream for tok in ch.token_ids]), daemon=True)
        t.start()
        assert wait_for(lambda: stream.attempts >= 2, timeout=60)  # refused at least once, retrying
        assert t.is_alive() and router.orchestrator.inflight == 1
        holder.cancel()
        t.join(120)
    assert not t.is_alive() and len(out) == 1 and len(out[0]) == 4
    assert stream.completion.finish_reason == "length" and stream.attempts >= 2
