"""HTTP streams that fail mid-answer, against real decode nodes (a tiny random model with
SmolLM2's vocabulary, in this process), real Redis and the router with migration off: a decode
node killed mid-stream ends the SSE stream with an OpenAI-style error event and no
``data: [DONE]`` (a client reading to the end must not take it for a finished answer); in a
batched ``/v1/completions`` call the other prompts' requests are aborted at once, on their own
live node too. Then the stream plumbing on plain data: the first failure of a batch ends it and
aborts every prompt, an error as a stream's first message is an HTTP status, and a stream that
raises is handed on, not dropped.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import time
import uuid

import pytest

from frontend.http_errors import ErrorResponse
from frontend.http_routes import _first_response, _interleaved
from protos.pdserve.v1 import serving_pb2 as pb
from tests.clusters import start_node, start_router
from tests.helpers import engine_config, wait_for

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from engine.models.tiny import save_tiny_chat_model

    # SmolLM2's vocabulary, so the router tokenizes chat prompts for real (as tests/test_chaos.py).
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "chat", seed=5)
    return model


class Cluster:
    """Decode nodes started on demand (no prefill node: every prompt prefills on its decode
    node) and a router with migration off, in a fresh namespace."""

    def __init__(self, redis_url: str, model) -> None:
        self.redis_url, self.model = redis_url, model
        self.ns = f"hsf-{uuid.uuid4().hex[:6]}"
        self.nodes: dict = {}
        self.router = start_router(redis_url, model, namespace=self.ns, http_port=0, max_model_len=1024,
                                   short_prompt_tokens=100_000, max_migrations=0, ready_min_prefill=0)
        self.host, port = self.router.http_address.rsplit(":", 1)
        self.port = int(port)

    def add_decode(self, node_id: str):
        node = self.nodes[node_id] = start_node("decode", node_id, engine_config(self.model, num_blocks=256),
                                                redis_url=self.redis_url, namespace=self.ns, lease_s=1.5,
                                                heartbeat_s=0.2, grpc_workers=8)
        assert wait_for(lambda: node_id in {n.node_id for n in self.router.orchestrator.refresher.view.nodes},
                        timeout=20), f"{node_id} never reached the router's view"
        return node

    def post(self, path: str, body: dict) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_S)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        return conn.getresponse()

    def stop(self) -> None:
        self.router.stop()
        for s in self.nodes.values():
            if s.aengine is not None and s.aengine.alive:
                s.stop(grace_s=0)


@pytest.fixture
def cluster(redis_url, chat_model):
    c = Cluster(redis_url, chat_model)
    yield c
    c.stop()


def crash(server) -> None:
    """As a dead process looks from outside: calls cut, engine gone, lease left to expire."""
    server.stop(deregister=False, grace_s=0)


def events(resp: http.client.HTTPResponse):
    """The SSE stream's data payloads, parsed ("[DONE]" as the string), as they arrive."""
    while line := resp.readline():
        if line.startswith(b"data: "):
            data = line[6:].strip()
            yield data.decode() if data == b"[DONE]" else json.loads(data)


def text_prompt(seed: int, words: int = 40) -> str:
    vocab = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")
    return " ".join(vocab[(seed * 7 + i * 3) % len(vocab)] + str(seed) for i in range(words))


def running(node) -> int:
    return node.aengine.load.running


def test_a_killed_node_ends_a_batched_completions_stream_with_an_error_and_aborts_the_other_prompt(cluster):
    # Each prompt's KV cached on its own node first, so that the batch usually splits across
    # the two nodes: prompt 0 on decode-b (alone when it was warmed), prompt 1 on decode-a. The
    # placement also weighs each node's fitted prefill cost, so it may not: then the node of
    # prompt 0 holds both, and what is checked is the end of the stream (the abort of a prompt
    # on a live node is checked on plain streams below, whatever the placement).
    p0, p1 = text_prompt(1), text_prompt(2)
    b = cluster.add_decode("decode-b")
    warm = {"model": "m", "max_tokens": 1, "temperature": 0}
    assert cluster.post("/v1/completions", {**warm, "prompt": p0}).status == 200
    a = cluster.add_decode("decode-a")
    assert cluster.post("/v1/completions", {**warm, "prompt": p1}).status == 200
    time.sleep(1.0)  # the nodes' block events reach the index (heartbeat 0.2 s)
    for node in (a, b):
        node.aengine.step_delay_s = 0.05  # 400 tokens would take 20 s: the kill lands mid-stream

    resp = cluster.post("/v1/completions", {"model": "m", "prompt": [p0, p1], "max_tokens": 400, "temperature": 0,
                                            "ignore_eos": True, "stream": True})
    assert resp.status == 200
    got, seen, killed, survivor = [], {0: 0, 1: 0}, None, None
    for ev in events(resp):
        got.append(ev)
        if isinstance(ev, dict) and ev.get("choices"):
            seen[ev["choices"][0]["index"]] += 1
        if killed is None and min(seen.values()) >= 3:
            victim = max((a, b), key=running)  # both prompts' node, or either when they split
            survivor = next((n for n in (a, b) if n is not victim and running(n) == 1), None)
            crash(victim)
            killed = time.monotonic()
    ended = time.monotonic()
    assert killed is not None, got
    assert "[DONE]" not in got, got[-3:]
    last = got[-1]
    assert set(last) == {"error"} and "decode node decode-" in last["error"]["message"], last
    assert last["error"]["code"] == "unavailable"
    if survivor is not None:  # the other prompt's request ends on its live node too, not left to run
        assert wait_for(lambda: running(survivor) == 0, timeout=10), "the other prompt still runs"
    assert wait_for(lambda: cluster.router.orchestrator.inflight == 0, timeout=10)
    assert ended - killed < 15


def test_a_killed_node_ends_a_chat_stream_with_an_error_event_and_no_done(cluster):
    node = cluster.add_decode("decode-0")
    node.aengine.step_delay_s = 0.05
    resp = cluster.post("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
        "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status == 200
    got, chunks = [], 0
    for ev in events(resp):
        got.append(ev)
        chunks += bool(isinstance(ev, dict) and ev.get("choices"))
        if chunks == 3:
            crash(node)
    assert chunks >= 3 and "[DONE]" not in got, got[-3:]
    assert set(got[-1]) == {"error"} and "decode node decode-0" in got[-1]["error"]["message"]
    assert not any(isinstance(ev, dict) and ev.get("usage") for ev in got)  # no usage as if it finished
    assert wait_for(lambda: cluster.router.orchestrator.inflight == 0, timeout=10)


# -- the plumbing, on plain messages -------------------------------------------------------------
def _chunk(i: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.Chunk(index=0, token_ids=[i], text=str(i)))


def test_an_error_as_the_first_message_is_an_http_status_and_closes_the_stream():
    closed = []

    async def stream():
        try:
            yield pb.GenerateResponse(error=pb.Error(code=3, message="bad thing"))  # INVALID_ARGUMENT
            yield _chunk(1)
        finally:
            closed.append(True)

    with pytest.raises(ErrorResponse) as e:
        asyncio.run(_first_response(stream()))
    assert (e.value.status, e.value.message, e.value.code) == (400, "bad thing", "invalid_argument")
    assert closed == [True]


def test_the_first_failure_of_a_batch_ends_the_response_and_aborts_every_prompt():
    """_completion_events over two plain streams: prompt 1 fails (an error message) while
    prompt 0 still streams; the response ends with the error event, no [DONE], prompt 0's
    stream is closed and every request of the call is aborted."""
    from frontend.http_routes import _completion_events
    from frontend.openai_responses import CompletionStream

    closed, aborted = [], []

    async def long_stream():
        try:
            for i in range(1000):
                await asyncio.sleep(0.001)
                yield _chunk(i)
        finally:
            closed.append(0)

    async def failing():
        yield _chunk(7)
        await asyncio.sleep(0.01)
        yield pb.GenerateResponse(error=pb.Error(code=14, message="decode node d-1 failed"))  # UNAVAILABLE

    class Served:
        config = type("C", (), {"model_name": "m"})

        async def abort(self, rids):
            aborted.extend(rids)

    async def run():
        encoders = CompletionStream.for_prompts("r", "m", 2, 1, False, False, str)
        return [e async for e in _completion_events(Served(), "r", ["r-0", "r-1"], [long_stream(), failing()],
                                                    [None, None], encoders, False)]

    out = asyncio.run(run())
    assert b"[DONE]" not in b"".join(out)
    assert json.loads(out[-1][6:]) == {"error": {"message": "decode node d-1 failed", "type": "service_unavailable",
                                                 "param": None, "code": "unavailable"}}
    assert closed == [0] and aborted == ["r-0", "r-1"]


def test_a_stream_that_raises_is_handed_on_after_its_output():
    async def ok():
        for i in range(3):
            await asyncio.sleep(0)
            yield _chunk(i)

    async def fails():
        yield _chunk(10)
        raise RuntimeError("lost the node client")

    async def collect():
        return [x async for x in _interleaved([ok(), fails()], [None, None])]

    got = asyncio.run(collect())
    outputs = sorted((i, r.chunk.token_ids[0]) for i, r in got if isinstance(r, pb.GenerateResponse))
    assert outputs == [(0, 0), (0, 1), (0, 2), (1, 10)]  # the other stream is not cut short by it
    failures = [(i, r) for i, r in got if isinstance(r, Exception)]
    assert len(failures) == 1 and failures[0][0] == 1 and str(failures[0][1]) == "lost the node client"
