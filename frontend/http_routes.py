"""The routes of the HTTP API, on one ``APIRouter`` that ``build_app`` includes:

    GET  /v1/models                 the served model
    POST /v1/chat/completions       chat, streaming (SSE, ends with ``data: [DONE]``) or not;
                                    structured outputs, tool calls parsed into OpenAI's shape
    POST /v1/completions            text or token prompts, batched prompts too
    GET  /health                    200 while the process runs
    GET  /ready                     200 once a decode node (and ready_min_prefill prefill nodes)
                                    are live in the index, else 503 saying what is missing;
                                    ``degraded`` (and why) while Redis fails (still 200)
    GET  /metrics                   the router's Prometheus metrics

The routes are module functions; what they answer from (the orchestrator, the metrics registry,
the readiness check) is one ``Served`` per app in ``app.state``, handed to each by ``Depends``.

Both APIs drive the same ``Orchestrator.generate`` as gRPC does, so a greedy answer is the
same text whichever way it was asked for, and a W3C ``traceparent`` header is continued as the
gRPC metadata is. A failure before any output is an HTTP status (``frontend/http_errors.py``); one
after the stream began is an error event in it, and the stream's last: no ``data: [DONE]``
follows, so a client that reads to the end can tell a failed stream from a finished one.

A client that goes away (a closed stream, a dropped connection while waiting for a
non-streaming answer) aborts the request on every node, so its KV blocks are freed at once
rather than when the request would have finished.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from functools import lru_cache
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from frontend import openai_protocol as oai
from frontend import openai_responses as oresp
from frontend.http_errors import ErrorResponse
from protos.pdserve.v1 import serving_pb2 as pb
from router.orchestrator import Orchestrator
from router.validation import RouterError
from telemetry import tracing

GenerateStream = AsyncIterator[pb.GenerateResponse]
log = logging.getLogger(__name__)


class Served:
    """What the routes answer from: one per app, in ``app.state.served``."""

    def __init__(self, orch: Orchestrator, metrics_registry=None,
                 readiness: Callable[[], tuple[bool, str]] | None = None) -> None:
        self.orch, self.config = orch, orch.config
        self.metrics_registry, self.readiness = metrics_registry, readiness
        # Logprobs name every token by its text, and the same ids recur across answers.
        self.token_text = lru_cache(maxsize=1 << 16)(self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        return self.orch.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_model(self, model: str) -> None:
        if model and model != self.config.model_name:
            raise ErrorResponse(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.config.model_name}`.", "invalid_request_error", "model_not_found", "model")

    def model_json(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
                "max_model_len": self.config.max_model_len}

    async def abort(self, rids: list[str]) -> None:
        with anyio.CancelScope(shield=True):  # runs while the response task is being cancelled
            for rid in rids:
                await self.orch.abort(rid)


async def _served(request: Request) -> Served:
    return request.app.state.served


ServedDep = Annotated[Served, Depends(_served)]
routes = APIRouter()


# -- plain endpoints ------------------------------------------------------------------------------
@routes.get("/health")
async def health():
    return {"status": "ok"}


@routes.get("/ready")
async def ready(served: ServedDep):
    ok, why = served.readiness() if served.readiness is not None else (True, "")
    # Degraded (Redis failing: placing by load, without the index) still serves, so stays 200.
    degraded = served.orch.refresher.degraded
    return JSONResponse({"ready": ok, "reason": why, "degraded": degraded is not None,
                         "degraded_reason": degraded or ""}, status_code=200 if ok else 503)


@routes.get("/metrics")
async def metrics(served: ServedDep):
    if served.metrics_registry is None:
        return Response("", media_type=CONTENT_TYPE_LATEST)
    return Response(generate_latest(served.metrics_registry), media_type=CONTENT_TYPE_LATEST)


@routes.get("/v1/models")
async def models(served: ServedDep):
    return {"object": "list", "data": [served.model_json()]}


@routes.get("/v1/models/{model}")
async def model(model: str, served: ServedDep):
    served.check_model(model)
    return served.model_json()


# -- generation helpers ---------------------------------------------------------------------------
def _request_id(request: Request) -> str:
    return request.headers.get("x-request-id") or uuid.uuid4().hex


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def _first_response(stream: GenerateStream) -> pb.GenerateResponse | None:
    """The first message, so that failures before any output (a refusal, or an error message
    first in the stream) become an HTTP status."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        return None
    except RouterError as e:
        raise ErrorResponse.from_router_error(e) from None
    if first.WhichOneof("kind") == "error":
        await stream.aclose()
        raise ErrorResponse.from_stream(first.error)
    return first


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect_unless_disconnected(served: Served, request: Request, rids: list[str], work) -> object:
    """Run ``work`` (a coroutine) unless the client leaves first; then abort ``rids``."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await served.abort(rids)
        raise ErrorResponse(499, "client closed the request", "cancelled", "cancelled")
    if task.exception() is not None:  # one prompt of a batch failed: the others stop too
        await served.abort(rids)
    return task.result()


async def _drain(stream: GenerateStream, first: pb.GenerateResponse | None) -> oresp.Collected:
    collected = oresp.Collected()
    if first is not None:
        collected.feed(first)
    async for resp in stream:
        collected.feed(resp)
    return collected


def _raise_stream_error(collected: oresp.Collected) -> None:
    if collected.error is not None:
        raise ErrorResponse.from_stream(collected.error)


def _failure_event(failure: pb.Error | BaseException) -> bytes:
    """The error event that ends a failed stream: an error message of the stream, or an
    exception raised while reading it (a router fault, logged here with its traceback)."""
    if isinstance(failure, pb.Error):
        return _sse(ErrorResponse.from_stream(failure).body())
    if isinstance(failure, RouterError):
        return _sse(ErrorResponse.from_router_error(failure).body())
    log.error("a response stream failed", exc_info=failure)
    return _sse(ErrorResponse.internal(failure).body())


# -- chat -----------------------------------------------------------------------------------------
@routes.post("/v1/chat/completions")
async def chat_completions(req: oai.ChatCompletionRequest, request: Request, served: ServedDep):
    served.check_model(req.model)
    rid = _request_id(request)
    try:
        greq = req.to_generate(rid)
    except oai.UnsupportedError as e:
        raise ErrorResponse.unsupported(e) from None
    stream = served.orch.generate(greq, trace_context=tracing.context_from_metadata(request.headers.items()),
                                  max_tokens_to_context=not greq.sampling.HasField("max_tokens"),
                                  authorization=request.headers.get("authorization"))  # the tenant's cache salt
    first = await _first_response(stream)
    headers = {"x-request-id": rid}
    model_name = served.config.model_name
    # Tools given (and tool_choice not "none"): the answer is read for calls in the model's format.
    tool_format = served.orch.tokenizer.tool_format if req.parses_tool_calls else None
    if not req.stream:
        collected = await _collect_unless_disconnected(served, request, [rid], _drain(stream, first))
        _raise_stream_error(collected)
        answer = (rid, model_name, collected, req.logprobs, served.token_text, tool_format)
        # A whole answer read for tool calls is parsed at once (linear, but a long answer is
        # tens of milliseconds of Python): on a worker thread, not the event loop.
        body = (oresp.chat_completion_json(*answer) if tool_format is None
                else await asyncio.to_thread(oresp.chat_completion_json, *answer))
        return JSONResponse(body, headers=headers)
    chat = oresp.ChatStream(rid, model_name, req.logprobs, req.include_usage, served.token_text, tool_format)
    return StreamingResponse(_chat_events(served, rid, chat, stream, first), media_type="text/event-stream",
                             headers=headers)


async def _chat_events(served: Served, rid: str, chat: oresp.ChatStream, stream: GenerateStream,
                       first: pb.GenerateResponse | None) -> AsyncIterator[bytes]:
    """The chat stream's events; a failure ends it with an error event and no [DONE]."""
    finished = False
    try:
        async with aclosing(_chained(first, stream)) as responses:
            try:
                async for resp in responses:
                    if resp.WhichOneof("kind") == "error":
                        yield _failure_event(resp.error)
                        return
                    for obj in chat.feed(resp):
                        yield _sse(obj)
            except Exception as e:  # noqa: BLE001 - the client is told, and the router logs it
                yield _failure_event(e)
                return
        if chat.include_usage:
            yield _sse(chat.usage_chunk())
        yield _sse("[DONE]")
        finished = True
    finally:
        if not finished:
            await served.abort([rid])


async def _chained(first: pb.GenerateResponse | None, stream: GenerateStream) -> GenerateStream:
    """``first`` (already read), then the rest of ``stream``; closing this closes ``stream``."""
    async with aclosing(stream):
        if first is not None:
            yield first
        async for resp in stream:
            yield resp


# -- completions ----------------------------------------------------------------------------------
@routes.post("/v1/completions")
async def completions(req: oai.CompletionRequest, request: Request, served: ServedDep):
    served.check_model(req.model)
    rid = _request_id(request)
    try:
        prompts = req.prompts()
        rids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        greqs = req.to_generate(rids)
    except oai.UnsupportedError as e:
        raise ErrorResponse.unsupported(e) from None
    trace_context = tracing.context_from_metadata(request.headers.items())
    auth = request.headers.get("authorization")  # its key salts the cache blocks per tenant
    streams = [served.orch.generate(g, trace_context=trace_context, authorization=auth) for g in greqs]
    # Every prompt is admitted (or refused) before any byte is sent: a batch fails as a whole.
    firsts = []
    try:
        for s in streams:
            firsts.append(await _first_response(s))
    except ErrorResponse:
        await served.abort(rids)
        raise
    headers = {"x-request-id": rid}
    model_name, want_lp = served.config.model_name, req.logprobs is not None
    if not req.stream:
        per_prompt = await _collect_unless_disconnected(served, request, rids, _drain_all(streams, firsts))
        for c in per_prompt:
            _raise_stream_error(c)
        return JSONResponse(oresp.completion_json(rid, model_name, per_prompt, req.n, want_lp, served.token_text),
                            headers=headers)
    encoders = oresp.CompletionStream.for_prompts(rid, model_name, len(streams), req.n, want_lp, req.include_usage,
                                                  served.token_text)
    events = _completion_events(served, rid, rids, streams, firsts, encoders, req.include_usage)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _drain_all(streams: Sequence[GenerateStream], firsts: Sequence[pb.GenerateResponse | None]):
    return await asyncio.gather(*(_drain(s, f) for s, f in zip(streams, firsts)))


async def _completion_events(served: Served, rid: str, rids: list[str], streams: Sequence[GenerateStream],
                             firsts: Sequence[pb.GenerateResponse | None], encoders: list[oresp.CompletionStream],
                             include_usage: bool) -> AsyncIterator[bytes]:
    """The prompts' streams interleaved as they come, each through its own encoder (one per
    prompt, all with the same ``created``), then the usage of them all if asked for. The first
    failure of any prompt (an error message, or an exception from its stream) ends the whole
    response with an error event and no [DONE], and the other prompts' requests are aborted."""
    finished = False
    try:
        async with aclosing(_interleaved(streams, firsts)) as responses:
            async for i, resp in responses:
                if isinstance(resp, BaseException):
                    yield _failure_event(resp)
                    return
                if resp.WhichOneof("kind") == "error":
                    yield _failure_event(resp.error)
                    return
                for obj in encoders[i].feed(resp):
                    yield _sse(obj)
        if include_usage:
            yield _sse(oresp.completion_usage_chunk(rid, served.config.model_name, encoders[0].created,
                                                    [e.collected for e in encoders]))
        yield _sse("[DONE]")
        finished = True
    finally:
        if not finished:
            await served.abort(rids)


async def _interleaved(streams: Sequence[GenerateStream], firsts: Sequence[pb.GenerateResponse | None]
                       ) -> AsyncIterator[tuple[int, pb.GenerateResponse | Exception]]:
    """(index, response) of every stream, in the order they arrive, or (index, exception) for
    a stream that raised: one pump task per stream feeds one queue; the tasks are cancelled
    (their requests aborted by the orchestrator) when this generator is closed."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(queue, i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    try:
        live = len(tasks)
        while live:
            i, resp = await queue.get()
            if resp is None:
                live -= 1
                continue
            yield i, resp
    finally:
        for t in tasks:
            t.cancel()


async def _pump(queue: asyncio.Queue, i: int, stream: GenerateStream, first: pb.GenerateResponse | None) -> None:
    try:
        if first is not None:
            await queue.put((i, first))
        async for resp in stream:
            await queue.put((i, resp))
    except Exception as e:  # noqa: BLE001 - handed on: the response ends with it, never drops it
        await queue.put((i, e))
    finally:
        await queue.put((i, None))  # this stream is done, however it ended
