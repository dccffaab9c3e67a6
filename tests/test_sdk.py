"""The pdserve SDK against a real gRPC server on 127.0.0.1.

The servicer here is a scripted PdServe (the prompt text says what to do), since what is under
test is the SDK's streaming, retry, deadline and error mapping, not the router.
"""
from __future__ import annotations

import asyncio
import collections
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import pdserve
from protos.pdserve.v1 import serving_pb2 as pb
from protos.pdserve.v1 import serving_pb2_grpc as pb_grpc


class ScriptedPdServe(pb_grpc.PdServeServicer):
    def __init__(self) -> None:
        self.attempts: collections.Counter[str] = collections.Counter()
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict] = []
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            self.attempts[request.request_id] += 1
            attempt = self.attempts[request.request_id]
            self.requests.append(request)
            self.metadata.append(dict(context.invocation_metadata()))
        script = request.text
        rid = request.request_id
        if script.startswith("unavailable-then-ok:"):
            if attempt <= int(script.split(":")[1]):
                context.abort(grpc.StatusCode.UNAVAILABLE, "no live decode node")
        elif script == "unavailable-after-chunk":
            yield pb.GenerateResponse(request_id=rid, chunk=pb.Chunk(index=0, token_ids=[1], text="a"))
            context.abort(grpc.StatusCode.UNAVAILABLE, "decode node lost")
        elif script == "overloaded-after-chunk":
            yield pb.GenerateResponse(request_id=rid, chunk=pb.Chunk(index=0, token_ids=[1], text="a"))
            context.set_trailing_metadata((("retry-after-ms", "10"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "node queue full")
        elif script == "slow":
            time.sleep(2.0)
        elif script == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt has 10 tokens, max_prompt_tokens is 5")
        elif script == "not-found":
            context.abort(grpc.StatusCode.NOT_FOUND, "model 'x' is not served; served: ['m']")
        elif script == "overloaded":
            context.set_trailing_metadata((("retry-after-ms", "1500"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "256 requests in flight")
        elif script == "in-stream-error":
            yield pb.GenerateResponse(request_id=rid, chunk=pb.Chunk(index=0, token_ids=[5], text="x"))
            yield pb.GenerateResponse(request_id=rid, error=pb.Error(code=13, message="decode node crashed"))
            return
        n = request.sampling.n if request.sampling.HasField("n") else 1
        for i in range(n):
            for t, text in ((7, "Hel"), (8, "lo")):
                yield pb.GenerateResponse(request_id=rid, chunk=pb.Chunk(index=i, token_ids=[t], text=text))
            yield pb.GenerateResponse(request_id=rid, complete=pb.Complete(
                index=i, finish_reason=pb.FINISH_REASON_LENGTH,
                usage=pb.Usage(prompt_tokens=3, completion_tokens=2, cached_prompt_tokens=1),
                timings=pb.Timings(first_token_s=0.01, total_s=0.02)))

    def Abort(self, request, context):
        return pb.AbortResponse(found=request.request_id == "running")

    def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.ModelInfo(id="m", max_context_length=2048)])


@pytest.fixture
def server():
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    servicer = ScriptedPdServe()
    pb_grpc.add_PdServeServicer_to_server(servicer, srv)
    health_servicer = health.HealthServicer()
    health_servicer.set("pdserve.v1.PdServe", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}", servicer
    srv.stop(0)


def client(target, **kw):
    kw.setdefault("backoff", (0.01, 0.05))
    return pdserve.Client(target, **kw)


def test_streaming_and_completion(server):
    target, servicer = server
    with client(target, metadata=[("x-tenant", "t1")]) as c:
        stream = c.generate("hello", max_tokens=2, temperature=0.0, seed=3, stop=["\n"], request_id="r1")
        chunks = list(stream)
        assert [ch.text for ch in chunks] == ["Hel", "lo"]
        assert [ch.token_ids for ch in chunks] == [(7,), (8,)]
        done = stream.completion
        assert (done.text, done.token_ids, done.finish_reason) == ("Hello", (7, 8), "length")
        assert done.usage == pdserve.Usage(3, 2, 1)
        assert done.timings.total_s == pytest.approx(0.02)
        sent = servicer.requests[-1]
        assert sent.request_id == "r1" and sent.text == "hello"
        assert sent.sampling.max_tokens == 2 and sent.sampling.HasField("temperature")
        assert sent.sampling.temperature == 0.0 and list(sent.sampling.stop) == ["\n"]
        assert not sent.sampling.HasField("top_p")  # unset stays unset: the server default
        assert servicer.metadata[-1]["x-tenant"] == "t1"
        # chat and token prompts
        c.complete([{"role": "user", "content": "hi"}])
        assert servicer.requests[-1].chat.messages[0].content == "hi"
        c.complete([1, 2, 3])
        assert list(servicer.requests[-1].tokens.ids) == [1, 2, 3]
        # n samples
        outs = c.complete_all("hello", n=2)
        assert [o.index for o in outs] == [0, 1] and all(o.text == "Hello" for o in outs)
        with pytest.raises(ValueError):
            c.complete("hello", n=2)


def test_deadline_exceeded(server):
    target, _ = server
    with client(target) as c:
        t0 = time.monotonic()
        with pytest.raises(pdserve.DeadlineExceededError):
            c.complete("slow", timeout=0.3)
        assert time.monotonic() - t0 < 1.5
    with client(target, timeout=0.3) as c:  # the client-wide default applies too
        with pytest.raises(pdserve.DeadlineExceededError):
            c.complete("slow")


def test_retries_unavailable_then_succeeds(server):
    target, servicer = server
    with client(target, retries=3) as c:
        stream = c.generate("unavailable-then-ok:2", request_id="retry-me")
        assert "".join(ch.text for ch in stream) == "Hello"
        assert stream.attempts == 3
        assert servicer.attempts["retry-me"] == 3


def test_retries_exhausted(server):
    target, servicer = server
    with client(target, retries=2) as c:
        with pytest.raises(pdserve.UnavailableError, match="no live decode node"):
            c.complete("unavailable-then-ok:100", request_id="never")
        assert servicer.attempts["never"] == 3


def test_no_retry_after_first_chunk(server):
    target, servicer = server
    with client(target, retries=5) as c:
        got = []
        with pytest.raises(pdserve.UnavailableError, match="decode node lost") as e:
            for ch in c.generate("unavailable-after-chunk", request_id="once"):
                got.append(ch.text)
        assert got == ["a"]
        assert servicer.attempts["once"] == 1
        # a cut stream says so, and that retrying is the caller's call
        assert isinstance(e.value, pdserve.StreamInterruptedError) and e.value.retryable
        assert e.value.chunks_received == 1 and "retry the request" in str(e.value)


def test_no_overload_retry_after_first_chunk(server):
    """RESOURCE_EXHAUSTED is retried only before any output, like UNAVAILABLE: once a chunk
    arrived, a new attempt would repeat it."""
    target, servicer = server
    with client(target) as c:
        got = []
        with pytest.raises(pdserve.ResourceExhaustedError, match="node queue full") as e:
            for ch in c.generate("overloaded-after-chunk", request_id="over-once"):
                got.append(ch.text)
        assert got == ["a"] and servicer.attempts["over-once"] == 1
        assert "not retried again" not in e.value.message


def test_retries_a_refused_connection_until_the_server_is_back():
    """Connection refused (a router restarting) is UNAVAILABLE before the first chunk: retried
    on the SDK's backoff, and the channel reconnects on the same backoff, so the call lands as
    soon as a server listens on the address again."""
    import socket

    with socket.socket() as s:  # a free port, nothing listening yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results: list = []
    with client(f"127.0.0.1:{port}", retries=1000, backoff=(0.02, 0.1), timeout=60) as c:
        stream = c.generate("hello", request_id="late")
        t = threading.Thread(target=lambda: results.append("".join(ch.text for ch in stream)))
        t.start()
        deadline = time.monotonic() + 30
        while stream.attempts < 2 and time.monotonic() < deadline:  # refused at least once
            time.sleep(0.01)
        srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))  # bound only now: refused until here
        servicer = ScriptedPdServe()
        pb_grpc.add_PdServeServicer_to_server(servicer, srv)
        srv.add_insecure_port(f"127.0.0.1:{port}")
        srv.start()
        try:
            t.join(60)
        finally:
            srv.stop(0)
    assert stream.attempts >= 2 and results == ["Hello"] and servicer.attempts["late"] == 1


def test_error_mapping(server):
    target, _ = server
    with client(target) as c:
        with pytest.raises(pdserve.InvalidRequestError, match="max_prompt_tokens is 5") as e:
            c.complete("invalid")
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(pdserve.NotFoundError, match="served"):
            c.complete("not-found")
    # Overload is retried after the server's hint (1.5 s), which is past this budget: no retry.
    with client(target, retry_budget_s=1.0) as c:
        with pytest.raises(pdserve.ResourceExhaustedError, match="past retry_budget_s=1;") as e:
            c.complete("overloaded")
        assert e.value.retry_after_s == pytest.approx(1.5) and "last status RESOURCE_EXHAUSTED" in e.value.message
    with client(target) as c:
        with pytest.raises(pdserve.PdServeError, match="decode node crashed") as e:
            list(c.generate("in-stream-error"))
        assert e.value.code == grpc.StatusCode.INTERNAL
    with pdserve.Client("127.0.0.1:1", retries=1, backoff=(0.01, 0.02)) as c:
        with pytest.raises(pdserve.UnavailableError):
            c.models(timeout=2)


def test_unary_calls(server):
    target, _ = server
    with client(target) as c:
        assert c.models() == [pdserve.ModelInfo("m", 2048)]
        assert c.abort("running") is True
        assert c.abort("gone") is False
        assert c.health() is True


def test_bad_arguments():
    with pytest.raises(ValueError, match="exactly one"):
        pdserve.client.build_request("x", token_ids=[1])
    with pytest.raises(ValueError, match="slo_class"):
        pdserve.client.build_request("x", slo_class="urgent")


def test_structured_outputs_and_tools_as_the_http_api_takes_them():
    build = pdserve.client.build_request
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = build("x", response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema,
                                                                            "strict": True}})
    assert rf.sampling.structured.kind == pb.STRUCTURED_KIND_JSON_SCHEMA and rf.sampling.structured.strict
    assert build("x", structured={"choice": ["a", "b"]}).sampling.structured.kind == pb.STRUCTURED_KIND_CHOICE
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "f", "arguments": {"a": 1}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    req = build(history, tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
                tool_choice={"type": "function", "function": {"name": "f"}}, parallel_tool_calls=False)
    assert [t.name for t in req.chat.tools] == ["f"] and req.chat.tool_choice.function == "f"
    assert req.chat.messages[1].tool_calls[0].arguments == '{"a": 1}' and req.chat.messages[2].tool_call_id == "c1"
    for kwargs, field in [(dict(response_format={"type": "json_object"}, structured={"regex": "a"}), "structured"),
                          (dict(response_format={"type": "grammar"}), "response_format.type"),
                          (dict(tools=[{"type": "function", "function": {"name": "f f"}}]), "tools"),
                          (dict(tool_choice="sometimes"), "tool_choice")]:
        with pytest.raises(pdserve.InvalidRequestError) as e:
            build([{"role": "user", "content": "x"}], **kwargs)
        assert e.value.field.startswith(field), (e.value.field, kwargs)
    with pytest.raises(pdserve.InvalidRequestError, match="need a chat prompt"):
        build("text prompt", tools=[{"type": "function", "function": {"name": "f"}}])


def test_tool_calls_of_a_complete_reach_the_completion():
    from pdserve.core import ResponseAccumulator

    acc = ResponseAccumulator()
    acc.feed(pb.GenerateResponse(chunk=pb.Chunk(index=0, text="<tool_call>...", token_ids=[1])))
    acc.feed(pb.GenerateResponse(complete=pb.Complete(
        index=0, finish_reason=pb.FINISH_REASON_TOOL_CALLS,
        tool_calls=[pb.ToolCall(id="call_1", name="f", arguments='{"a": 1}')])))
    done = acc.completions[0]
    assert done.finish_reason == "tool_calls" and done.text == "<tool_call>..."
    assert done.tool_calls == (pdserve.ToolCall("call_1", "f", '{"a": 1}'),)
    assert done.tool_calls[0].parsed_arguments() == {"a": 1}


def test_async_client(server):
    target, servicer = server

    async def main():
        async with pdserve.AsyncClient(target, backoff=(0.01, 0.05)) as c:
            stream = c.generate("hello", max_tokens=2)
            texts = [ch.text async for ch in stream]
            assert texts == ["Hel", "lo"] and stream.completion.text == "Hello"
            s2 = c.generate("unavailable-then-ok:1", request_id="aretry")
            assert "".join([ch.text async for ch in s2]) == "Hello"
            assert s2.attempts == 2 and servicer.attempts["aretry"] == 2
            got = []
            with pytest.raises(pdserve.StreamInterruptedError):
                async for ch in c.generate("unavailable-after-chunk", request_id="aonce"):
                    got.append(ch.text)
            assert got == ["a"] and servicer.attempts["aonce"] == 1
            with pytest.raises(pdserve.DeadlineExceededError):
                await c.complete("slow", timeout=0.3)
        async with pdserve.AsyncClient(target, backoff=(0.01, 0.05), retry_budget_s=1.0) as c:
            with pytest.raises(pdserve.ResourceExhaustedError, match="retry budget spent") as e:
                await c.complete("overloaded")
            assert e.value.retry_after_s == pytest.approx(1.5)
            with pytest.raises(pdserve.InvalidRequestError):
                await c.complete("invalid")
            assert await c.models() == [pdserve.ModelInfo("m", 2048)]
            assert await c.abort("running") is True
            assert await c.health() is True

    asyncio.run(main())


def test_sdk_imports_no_torch_or_ray():
    code = "import sys, pdserve; bad = [m for m in ('torch', 'ray') if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
