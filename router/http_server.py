"""The router's HTTP front: OpenAI-compatible API, Prometheus ``/metrics``, ``/health`` and
``/ready``; FastAPI served by uvicorn on the router's own event loop, beside its gRPC server.

    GET  /v1/models                 the served model
    POST /v1/chat/completions       chat, streaming (SSE, ends with ``data: [DONE]``) or not
    POST /v1/completions            text or token prompts, batched prompts too
    GET  /health                    200 while the process runs
    GET  /ready                     200 once a decode node (and ready_min_prefill prefill nodes)
                                    are live in the index, else 503 saying what is missing
    GET  /metrics                   the router's Prometheus metrics

Both APIs drive the same ``Orchestrator.generate`` as gRPC does, so a greedy answer is the
same text whichever way it was asked for, and a W3C ``traceparent`` header is continued as the
gRPC metadata is. Errors are OpenAI's JSON shape with the status a
client can act on: 400 names the limit, 404 an unknown model, 429 (overload, SLO) and 503 (no
node) carry ``Retry-After`` and ``retry-after-ms`` (the official client honours both).

A client that goes away (a closed stream, a dropped connection while waiting for a
non-streaming answer) aborts the request on every node, so its KV blocks are freed at once
rather than when the request would have finished.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from functools import lru_cache

import anyio
import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kv_index.nodes import Role
from protos.pdserve.v1 import serving_pb2 as pb
from router import openai_protocol as oai
from router.orchestrator import Orchestrator, RouterError
from security.api_keys import MISSING, ApiKeys
from telemetry import tracing

log = logging.getLogger(__name__)

# gRPC status -> (HTTP status, OpenAI error type). 499 is nginx's "client closed request".
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}
_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}
# A 503 without a hint from the cluster: about one node-view refresh.
DEFAULT_RETRY_AFTER_MS = 1000


class ErrorResponse(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | int | None = None,
                 param: str | None = None, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.retry_after_ms = retry_after_ms

    @staticmethod
    def from_grpc(code: grpc.StatusCode, message: str, retry_after_ms: int | None = None,
                  param: str | None = None) -> ErrorResponse:
        status, type_ = HTTP_STATUS.get(code, (500, "internal_error"))
        if status in (429, 503) and retry_after_ms is None:
            retry_after_ms = DEFAULT_RETRY_AFTER_MS
        return ErrorResponse(status, message, type_, code.name.lower(), param, retry_after_ms=retry_after_ms)

    def body(self) -> dict:
        return oai.error_json(self.message, self.type, self.code, self.param)

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_ms is not None:
            headers = {"Retry-After": str(max(1, math.ceil(self.retry_after_ms / 1000))),
                       "retry-after-ms": str(self.retry_after_ms)}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# Answered without a key: probes and scrapers send none, and they tell nothing about prompts.
OPEN_PATHS = ("/health", "/ready", "/metrics")


def require_api_key(app: FastAPI, keys: ApiKeys) -> None:
    """Every route but OPEN_PATHS answers 401 in OpenAI's shape without an accepted
    ``Authorization: Bearer`` key."""

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if request.url.path in OPEN_PATHS:
            return await call_next(request)
        why = keys.check_authorization(request.headers.get("authorization"))
        if why is None:
            return await call_next(request)
        code = None if why == MISSING else "invalid_api_key"
        return JSONResponse(oai.error_json(why, "invalid_request_error", code, None), status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})


class BodyLimit:
    """Refuse with 413 a body over ``max_bytes`` (the gRPC API's message limit): FastAPI would
    otherwise hold any size in memory to parse it. A Content-Length over the limit is refused
    before anything is read; a body without one (``Transfer-Encoding: chunked``), or one that
    sends more than it declared, is counted as it arrives and refused as soon as it passes the
    limit, so no more than ``max_bytes`` (plus one network read) is ever held. The body is read
    here and handed to the app whole; after it the app gets the real ``receive``, so the
    disconnect detection of the routes works as before. Plain ASGI."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, what: str) -> ErrorResponse:
        return ErrorResponse(413, f"the request body has {what} bytes; at most {self.max_bytes} are accepted "
                             "(max_message_bytes)", "invalid_request_error", "body_too_large")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(str(int(length))).response()(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body was complete
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(f"more than {self.max_bytes}").response()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


_HTTP_CODES = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}
# GenerateRequest's prompt fields, as the OpenAI request names them.
_PROMPT_PARAMS = {"text": "prompt", "tokens": "prompt", "tokens.ids": "prompt", "chat": "messages",
                  "chat.messages": "messages"}
# Names pydantic puts in an error's loc for the member types of a union, not fields.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _param(loc) -> str | None:
    """A validation error's field path (``messages.0.content``), without "body" and the
    union member tags pydantic inserts (``function-after[_utf8(), str]``)."""
    keep = [str(x) for x in loc if isinstance(x, int)
            or (x != "body" and x not in _TYPE_TAGS and str(x).isidentifier())]
    return ".".join(keep) or None


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def build_app(orch: Orchestrator, metrics_registry=None,
              readiness: Callable[[], tuple[bool, str]] | None = None) -> FastAPI:
    cfg = orch.config
    app = FastAPI(title="pdserve", description="OpenAI-compatible API of a pdserve cluster",
                  docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=cfg.max_message_bytes)

    @lru_cache(maxsize=1 << 16)
    def token_text(token_id: int) -> str:
        return orch.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_model(model: str) -> None:
        if model and model != cfg.model_name:
            raise ErrorResponse(404, f"The model `{model}` does not exist; this server serves "
                                f"`{cfg.model_name}`.", "invalid_request_error", "model_not_found", "model")

    def request_id(request: Request) -> str:
        return request.headers.get("x-request-id") or uuid.uuid4().hex

    if cfg.api_keys:
        require_api_key(app, ApiKeys(cfg.api_keys))

    @app.exception_handler(ErrorResponse)
    async def _error(request: Request, exc: ErrorResponse):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors() or [{"loc": (), "msg": "invalid request", "type": ""}]
        # A union field (prompt, stop, content) fails once per member type: our own value
        # checks (token id ranges, UTF-8) say more than "Input should be a valid string".
        first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
        if first.get("type") == "json_invalid":  # its loc is a byte offset, not a field
            offset = first.get("loc", ("body", "?"))[-1]
            why = first.get("ctx", {}).get("error", first["msg"])
            return JSONResponse(oai.error_json(f"the request body is not valid JSON ({why} at byte {offset})",
                                               "invalid_request_error", "invalid_json"), status_code=400)
        param = _param(first.get("loc", ()))
        message = f"{param}: {first['msg']}" if param else f"the request body: {first['msg']}"
        return JSONResponse(oai.error_json(message, "invalid_request_error", "invalid_value", param),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI's own refusals (a body it cannot decode, unknown routes, wrong methods) in
        # OpenAI's error shape, like every other error of this API.
        message, code = str(exc.detail), _HTTP_CODES.get(exc.status_code)
        if exc.status_code == 400:  # FastAPI says this only of a body it could not decode
            message = f"the request body must be JSON in UTF-8 ({message})"
        type_ = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return JSONResponse(oai.error_json(message, type_, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    # -- plain endpoints ------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        ok, why = readiness() if readiness is not None else (True, "")
        return JSONResponse({"ready": ok, "reason": why}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        if metrics_registry is None:
            return Response("", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": cfg.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
            "max_model_len": cfg.max_model_len}]}

    @app.get("/v1/models/{model}")
    async def model(model: str):
        check_model(model)
        return {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
                "max_model_len": cfg.max_model_len}

    # -- generation -------------------------------------------------------------------------------
    async def first_response(stream: AsyncIterator[pb.GenerateResponse]) -> pb.GenerateResponse | None:
        """The first message, so that failures before any output become an HTTP status."""
        try:
            return await anext(stream)
        except StopAsyncIteration:
            return None
        except RouterError as e:
            raise ErrorResponse.from_grpc(e.code, e.message, e.retry_after_ms,
                                          _PROMPT_PARAMS.get(e.param, e.param)) from None

    async def abort(rids: list[str]) -> None:
        with anyio.CancelScope(shield=True):  # runs while the response task is being cancelled
            for rid in rids:
                await orch.abort(rid)

    async def until_disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def collect_unless_disconnected(request: Request, rids: list[str], work) -> object:
        """Run ``work`` (a coroutine) unless the client leaves first; then abort ``rids``."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            task.cancel()
            await abort(rids)
            raise ErrorResponse(499, "client closed the request", "cancelled", "cancelled")
        return task.result()

    async def drain(stream, collected: oai.Collected, first: pb.GenerateResponse | None) -> oai.Collected:
        if first is not None:
            collected.feed(first)
        async for resp in stream:
            collected.feed(resp)
        return collected

    def raise_stream_error(collected: oai.Collected) -> None:
        if collected.error is not None:
            code = _CODE_BY_VALUE.get(collected.error.code, grpc.StatusCode.INTERNAL)
            raise ErrorResponse.from_grpc(code, collected.error.message)

    def stream_error_event(err: pb.Error) -> bytes:
        code = _CODE_BY_VALUE.get(err.code, grpc.StatusCode.INTERNAL)
        return _sse(ErrorResponse.from_grpc(code, err.message).body())

    @app.post("/v1/chat/completions")
    async def chat_completions(req: oai.ChatCompletionRequest, request: Request):
        check_model(req.model)
        rid = request_id(request)
        try:
            greq = req.to_generate(rid)
        except oai.UnsupportedError as e:
            raise ErrorResponse(400, str(e), "invalid_request_error", "unsupported", e.param) from None
        stream = orch.generate(greq, trace_context=tracing.context_from_metadata(request.headers.items()),
                               max_tokens_to_context=not greq.sampling.HasField("max_tokens"))
        first = await first_response(stream)
        headers = {"x-request-id": rid}
        if not req.stream:
            collected = await collect_unless_disconnected(request, [rid], drain(stream, oai.Collected(), first))
            raise_stream_error(collected)
            return JSONResponse(oai.chat_completion_json(rid, cfg.model_name, collected, req.logprobs, token_text),
                                headers=headers)

        chat = oai.ChatStream(rid, cfg.model_name, req.logprobs, req.include_usage, token_text)

        async def events():
            finished = False
            try:
                if first is not None:
                    for obj in chat.feed(first):
                        yield _sse(obj)
                async for resp in stream:
                    if resp.WhichOneof("kind") == "error":
                        yield stream_error_event(resp.error)
                    for obj in chat.feed(resp):
                        yield _sse(obj)
                if req.include_usage:
                    yield _sse(chat.usage_chunk())
                yield _sse("[DONE]")
                finished = True
            finally:
                if not finished:
                    await abort([rid])

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/completions")
    async def completions(req: oai.CompletionRequest, request: Request):
        check_model(req.model)
        rid = request_id(request)
        try:
            prompts = req.prompts()
            rids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
            greqs = req.to_generate(rids)
        except oai.UnsupportedError as e:
            raise ErrorResponse(400, str(e), "invalid_request_error", "unsupported", e.param) from None
        trace_context = tracing.context_from_metadata(request.headers.items())
        streams = [orch.generate(g, trace_context=trace_context) for g in greqs]
        # Every prompt is admitted (or refused) before any byte is sent: a batch fails as a whole.
        firsts = []
        try:
            for s in streams:
                firsts.append(await first_response(s))
        except ErrorResponse:
            await abort(rids)
            raise
        headers = {"x-request-id": rid}
        want_lp = req.logprobs is not None
        if not req.stream:
            async def all_of():
                return await asyncio.gather(*(drain(s, oai.Collected(), f) for s, f in zip(streams, firsts)))

            per_prompt = await collect_unless_disconnected(request, rids, all_of())
            for c in per_prompt:
                raise_stream_error(c)
            return JSONResponse(oai.completion_json(rid, cfg.model_name, per_prompt, req.n, want_lp, token_text),
                                headers=headers)

        created = oai._now()
        encoders = [oai.CompletionStream(rid, cfg.model_name, i, req.n, want_lp, req.include_usage, token_text,
                                         created) for i in range(len(streams))]

        async def events():
            finished = False
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, s, first) -> None:
                try:
                    if first is not None:
                        await queue.put((i, first))
                    async for resp in s:
                        await queue.put((i, resp))
                finally:
                    await queue.put((i, None))

            tasks = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
            try:
                live = len(tasks)
                while live:
                    i, resp = await queue.get()
                    if resp is None:
                        live -= 1
                        continue
                    if resp.WhichOneof("kind") == "error":
                        yield stream_error_event(resp.error)
                    for obj in encoders[i].feed(resp):
                        yield _sse(obj)
                if req.include_usage:
                    yield _sse(oai.completion_usage_chunk(rid, cfg.model_name, created,
                                                          [e.collected for e in encoders]))
                yield _sse("[DONE]")
                finished = True
            finally:
                for t in tasks:
                    t.cancel()
                if not finished:
                    await abort(rids)

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return app


def node_readiness(orch: Orchestrator, min_prefill: int) -> Callable[[], tuple[bool, str]]:
    """/ready: a decode node and ``min_prefill`` prefill nodes live in the router's node view."""

    def check() -> tuple[bool, str]:
        if orch.draining:
            return False, "the router is shutting down (draining)"
        view = orch.refresher.view
        decode = sum(1 for n in view.nodes if n.role == Role.DECODE)
        prefill = sum(1 for n in view.nodes if n.role == Role.PREFILL)
        missing = []
        if decode < 1:
            missing.append("no live decode node")
        if prefill < min_prefill:
            missing.append(f"{prefill} live prefill nodes (need {min_prefill})")
        if missing:
            return False, "; ".join(missing) + (f" ({view.error})" if view.error else "")
        return True, f"{prefill} prefill and {decode} decode nodes live"

    return check


class HttpServer:
    """uvicorn on the caller's running event loop. ``start`` binds (port 0 = a free one) and
    returns "host:port" once it accepts connections."""

    def __init__(self, app: FastAPI, host: str, port: int, ssl: dict | None = None,
                 limit_concurrency: int | None = None) -> None:
        self.app, self.host, self.port = app, host, port
        # Connections + requests uvicorn holds at once; beyond it 503 at once (a bound on the
        # router's memory under overload; admission answers 429 well before it).
        self.limit_concurrency = limit_concurrency
        self.ssl = ssl or {}  # uvicorn's ssl_* keywords: HTTPS (security.tls.uvicorn_ssl)
        self.address: str | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> str:
        # Bind here, not in uvicorn, so port 0 works and the bound port is known at once.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.set_inheritable(True)
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, limit_concurrency=self.limit_concurrency, **self.ssl)
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the bind/startup error
                raise OSError(f"HTTP server on {self.host}:{self.port} stopped during startup")
            await asyncio.sleep(0.01)
        port = sock.getsockname()[1]
        host = f"[{self.host}]" if family == socket.AF_INET6 else self.host
        self.address = f"{host}:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(self._task, timeout=10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._server.force_exit = True
