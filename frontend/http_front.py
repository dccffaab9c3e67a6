"""The HTTP front door: what bounds a request before the routes see it, at the two layers where
each bound can be kept.

    connection (uvicorn's h11 protocol: ``frontend/http_conn.py``)
      open connections at most http_max_connections                       -> 429, nothing read
      headers complete within header_timeout_s                             -> 408 (slowloris)
      a body read only as the app asks for it; a response the client stops reading for
      http_send_timeout_s: dropped, the request aborted; lingering closes
    request (ASGI, ``FrontDoor``), in this order
      body limit    a Content-Length over the limit                      -> 413, nothing read
      admission     past ``Admission.limit`` requests at once             -> 429 + Retry-After
      byte budget   a body the budget cannot hold                        -> 429 + Retry-After
                    (both hints from how fast admitted requests leave: ``RetryHint``)
      body timeout  the whole body within body_timeout_s                 -> 408
      JSON depth    nested deeper than MAX_BODY_DEPTH                     -> 400 naming it
      parsed size   the body's bytes plus what parsing them makes (``body_shape``): counted
                    in the byte budget too -> 429, or 413 when more than the whole budget
      then the body, whole, to the app; its bytes stay counted until the response has ended

Every refusal is in OpenAI's error shape and closes the connection (its body was not read, so
the connection cannot carry another request). The probes (/health, /ready, /metrics) are not
counted by admission: an overloaded router must still answer its liveness probe. The pure
arithmetic of the bounds is ``frontend/http_budget.py``.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from frontend.http_budget import MAX_BODY_DEPTH, Admission, ByteBudget, RetryHint, body_limit_bytes, body_shape
from frontend.http_errors import ErrorResponse
from router.config import RouterConfig

# Answered without a key and without admission: probes and scrapers; they carry no prompt.
OPEN_PATHS = ("/health", "/ready", "/metrics")


@dataclass
class FrontLimits:
    """The bounds of one HTTP server, and the state they keep (shared by its requests)."""

    body_limit: int
    budget: ByteBudget
    admission: Admission
    body_timeout_s: float
    retry: RetryHint
    # Where body_limit comes from, for the 413's message.
    body_limit_source: str = "max_body_bytes"
    refused: dict[str, int] = field(default_factory=dict)
    # The connection layer's (frontend/http_conn.py): open connections, the send deadline.
    connections: Admission = field(default_factory=lambda: Admission(1024))
    send_timeout_s: float = 30.0
    on_refused: Callable[[str], None] | None = None  # the router's requests_rejected metric

    def count_refusal(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        if self.on_refused is not None:
            self.on_refused(reason)


def front_limits(cfg: RouterConfig, tokenizer) -> FrontLimits:
    """The bounds ``cfg`` sets; the body limit from the model's context and ``tokenizer``
    (its ``max_token_json_bytes``) unless ``cfg.max_body_bytes`` sets it."""
    if cfg.max_body_bytes is not None:
        limit, source = cfg.max_body_bytes, "max_body_bytes"
    else:
        per_token = getattr(tokenizer, "max_token_json_bytes", None)
        if per_token is None:
            raise ValueError("max_body_bytes must be set when the tokenizer is not known")
        limit = body_limit_bytes(cfg.max_model_len, per_token)
        source = (f"max_body_bytes: what max_model_len {cfg.max_model_len} tokens can use, "
                  f"at most {per_token} bytes of JSON each")
    if cfg.max_buffered_bytes < limit:
        raise ValueError(f"max_buffered_bytes ({cfg.max_buffered_bytes}) must hold one body of the largest size "
                         f"({limit}, {source})")
    return FrontLimits(limit, ByteBudget(cfg.max_buffered_bytes), Admission(cfg.rpc_limit), cfg.http_body_timeout_s,
                       RetryHint(cfg.retry_after_ms), source, connections=Admission(cfg.http_max_connections),
                       send_timeout_s=cfg.http_send_timeout_s)


class FrontDoor:
    """Admission, the body limit, the byte budget and the body timeout (see the module doc),
    then the body handed to the app whole; after it the app gets the real ``receive``, so
    the routes still see the client's disconnect. ``on_refused(reason)`` counts each refusal
    (the router's requests_rejected metric). Plain ASGI."""

    def __init__(self, app, limits: FrontLimits, on_refused=None) -> None:
        self.app, self.limits = app, limits
        if on_refused is not None:  # the connection layer's refusals are counted there too
            limits.on_refused = on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lim = self.limits
        length = _content_length(scope)
        if length is not None and length > lim.body_limit:  # first: the one answer that retrying won't change
            await self._refuse("body_too_large", self._too_large(str(length)), scope, receive, send)
            return
        counted = scope["path"] not in OPEN_PATHS
        if counted and not lim.admission.try_enter():
            await self._refuse("http_overloaded", self._overloaded(), scope, receive, send)
            return
        taken = [0]  # bytes of lim.budget this request holds, given back when it ends
        status = [0]

        async def recording_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._serve(scope, receive, recording_send, length, taken)
        finally:
            lim.budget.give_back(taken[0])
            if counted:
                lim.admission.leave()
                if status[0] not in (408, 413, 429):  # it held its slot for real work: the drain
                    lim.retry.finished(time.monotonic())

    def _hinting(self, send):
        """``send``, but a 429 of the app (the orchestrator's max_inflight, a node's queue) is
        a refusal like the front door's own: it counts in the hint, and its Retry-After is
        raised to the hint when that is longer (a fixed short hint brings the same clients
        back at once)."""

        async def hinting_send(message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 429:
                hint = self._retry_ms()
                headers = dict(message.get("headers", []))
                if hint > int(headers.get(b"retry-after-ms", b"0") or 0):
                    headers[b"retry-after-ms"] = str(hint).encode()
                    headers[b"retry-after"] = str(max(1, -(-hint // 1000))).encode()
                    message = {**message, "headers": list(headers.items())}
            await send(message)

        return hinting_send

    async def _serve(self, scope, receive, send, length: int | None, taken: list[int]) -> None:
        lim = self.limits
        if length is not None and length > 0:
            if not lim.budget.try_take(length):
                await self._refuse("body_budget", self._no_room(length), scope, receive, send)
                return
            taken[0] = length
        body = await self._read_body(scope, receive, send, length, taken)
        if body is None or (body and not await self._take_parsed(body, scope, receive, send, taken)):
            return
        replayed = False

        async def replay():
            nonlocal replayed, body
            if not replayed:
                replayed, whole = True, body
                body = None  # the app holds it now; this closure need not keep it too
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()

        await self.app(scope, replay, self._hinting(send))

    async def _read_body(self, scope, receive, send, length: int | None, taken: list[int]) -> bytes | None:
        """The whole body, or None after answering (too large, no room, too slow, or the
        client left before sending it all)."""
        lim = self.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + lim.body_timeout_s
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await self._refuse("body_timeout", self._too_slow(size, length), scope, receive, send)
                return None
            if message["type"] != "http.request":  # the client left before its body was complete
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > lim.body_limit:
                await self._refuse("body_too_large", self._too_large(f"more than {lim.body_limit}"),
                                   scope, receive, send)
                return None
            extra = size - taken[0]  # a chunked body takes its bytes as they come
            if extra > 0:
                if not lim.budget.try_take(extra):
                    await self._refuse("body_budget", self._no_room(extra), scope, receive, send)
                    return None
                taken[0] += extra
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _take_parsed(self, body: bytes, scope, receive, send, taken: list[int]) -> bool:
        """The body's nesting checked and its parsed size taken from the budget, before the app
        parses it; False after answering (too deep, or no room for what parsing makes)."""
        lim = self.limits
        # The measure is C-speed (~5 ms a MiB); past 64 KiB it runs on a thread, so that a
        # large body does not hold the event loop while it is measured.
        shape = body_shape(body) if len(body) <= 1 << 16 else await asyncio.to_thread(body_shape, body)
        if shape.depth > MAX_BODY_DEPTH:
            await self._refuse("json_depth", ErrorResponse(
                400, f"the request body nests JSON {shape.depth} levels deep; at most {MAX_BODY_DEPTH} are accepted "
                f"(the JSON depth limit)", "invalid_request_error", "json_too_deep"), scope, receive, send)
            return False
        extra = shape.parsed_bytes
        if taken[0] + extra > lim.budget.capacity:  # more than the whole budget: retrying cannot help
            await self._refuse("body_too_large", ErrorResponse(
                413, f"the request body's {len(body)} bytes hold {shape.values} JSON values, about {extra} bytes once "
                f"parsed; with the body that is more than max_buffered_bytes ({lim.budget.capacity}) can hold",
                "invalid_request_error", "body_too_large"), scope, receive, send)
            return False
        if not lim.budget.try_take(extra):
            await self._refuse("body_budget", self._no_room(extra), scope, receive, send)
            return False
        taken[0] += extra
        return True

    async def _refuse(self, reason: str, error: ErrorResponse, scope, receive, send) -> None:
        self.limits.count_refusal(reason)
        await error.response(close=True)(scope, receive, send)

    def _retry_ms(self) -> int:
        now = time.monotonic()
        self.limits.retry.refused(now)
        return self.limits.retry.hint_ms(now)

    def _overloaded(self) -> ErrorResponse:
        lim, retry = self.limits, self._retry_ms()
        return ErrorResponse.from_grpc(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{lim.admission.active} HTTP requests in flight, the most this router admits at once; "
            f"retry after {retry} ms", retry)

    def _no_room(self, n: int) -> ErrorResponse:
        lim, retry = self.limits, self._retry_ms()
        return ErrorResponse.from_grpc(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the router holds {lim.budget.held} bytes of request bodies and cannot take {n} more "
            f"(max_buffered_bytes {lim.budget.capacity}); retry after {retry} ms", retry)

    def _too_large(self, what: str) -> ErrorResponse:
        lim = self.limits
        return ErrorResponse(413, f"the request body has {what} bytes; at most {lim.body_limit} are accepted "
                             f"({lim.body_limit_source})", "invalid_request_error", "body_too_large")

    def _too_slow(self, size: int, length: int | None) -> ErrorResponse:
        of = f" of {length}" if length is not None else ""
        return ErrorResponse(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s "
                             f"(http_body_timeout_s): {size}{of} bytes came", "invalid_request_error", "body_timeout")


def _content_length(scope) -> int | None:
    # h11 has already refused a malformed or repeated Content-Length (400).
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value)
    return None
