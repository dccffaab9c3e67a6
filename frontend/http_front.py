"""The HTTP front door: what bounds a request before the routes see it, at the two layers where
each bound can be kept.

    connection (uvicorn's h11 protocol, ``guarded_protocol``)
      headers complete within header_timeout_s of the connection opening (or of the last
      response), else 408 and a short lingering close: uvicorn alone waits for them forever
      (slowloris)
      a body is read only as the app asks for it: a refused request costs one socket read
      a refused client still sending its body gets the answer, then a lingering close
    request (ASGI, ``FrontDoor``), in this order
      body limit    a Content-Length over the limit                      -> 413, nothing read
      admission     past ``Admission.limit`` requests at once             -> 429 + Retry-After
      byte budget   a body the budget cannot hold                        -> 429 + Retry-After
                    (both hints from how fast admitted requests leave: ``RetryHint``)
      body timeout  the whole body within body_timeout_s                 -> 408
      then the body, whole, to the app; its bytes stay counted until the response has ended

Every refusal is in OpenAI's error shape and closes the connection (its body was not read, so
the connection cannot carry another request). The probes (/health, /ready, /metrics) are not
counted by admission: an overloaded router must still answer its liveness probe. The pure
arithmetic of the bounds is ``frontend/http_budget.py``.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import grpc
import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from frontend import openai_protocol as oai
from frontend.http_budget import Admission, ByteBudget, RetryHint, body_limit_bytes
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
                       RetryHint(cfg.retry_after_ms), source)


class FrontDoor:
    """Admission, the body limit, the byte budget and the body timeout (see the module doc),
    then the body handed to the app whole; after it the app gets the real ``receive``, so
    the routes still see the client's disconnect. ``on_refused(reason)`` counts each refusal
    (the router's requests_rejected metric). Plain ASGI."""

    def __init__(self, app, limits: FrontLimits, on_refused=None) -> None:
        self.app, self.limits, self.on_refused = app, limits, on_refused

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
        if body is None:
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

    async def _refuse(self, reason: str, error: ErrorResponse, scope, receive, send) -> None:
        lim = self.limits
        lim.refused[reason] = lim.refused.get(reason, 0) + 1
        if self.on_refused is not None:
            self.on_refused(reason)
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


def _header_timeout_response(timeout_s: float) -> bytes:
    body = json.dumps(oai.error_json(f"the request headers did not arrive within {timeout_s:g} s "
                                     "(http_header_timeout_s)", "invalid_request_error", "header_timeout")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


# A refused request's client is still sending its body: closing at once would reset the
# connection (unread data), and most clients, sending before they read, would see the reset
# instead of the answer. So the answer is followed by our FIN and the rest of the body is read
# and dropped: for at most LINGER_S, LINGER_IDLE_S without a byte, and the body limit's bytes
# plus LINGER_EXTRA_BYTES (nginx's lingering close, with its 30 s and 5 s). The reading starts
# LINGER_QUIET_S after the answer: a client that reads while it sends has seen the answer and
# gone by then, and its body is never read at all.
LINGER_S = 30.0
LINGER_IDLE_S = 5.0
LINGER_QUIET_S = 0.5
LINGER_EXTRA_BYTES = 64 * 1024
# A client cut off by the header deadline may be writing a header byte as its 408 goes out.
# Closing outright with that byte unread (or arriving just after) makes the kernel send a reset
# in place of our FIN, and a client that gets the reset before it has read the 408 loses it
# (asyncio's read() raises; seen once in CI on the slowloris test). So the 408 is followed by
# our FIN and whatever still arrives is read and dropped, for at most HEADER_LINGER_S and
# HEADER_LINGER_BYTES: a slowloris client holds its socket that much longer, no more.
HEADER_LINGER_S = 2.0
HEADER_LINGER_BYTES = 16 * 1024
# Bytes per socket read (asyncio reads 256 KiB by default). Until a request's headers are
# complete, reads are small: thousands of connections waiting for admission then hold a few
# MiB of read-ahead, not 256 KiB each. A body the app has taken on, or drops, is read in
# asyncio's usual pieces.
HEADER_READ_BYTES = 16 * 1024
BODY_READ_BYTES = 256 * 1024


class _LingeringTransport:
    """The transport as uvicorn sees it: ``close`` asks the protocol, which may linger."""

    def __init__(self, transport, protocol: _GuardedH11Protocol) -> None:
        self._transport, self._protocol = transport, protocol

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def resume_reading(self) -> None:
        self._protocol._app_reads()
        self._transport.resume_reading()

    def close(self) -> None:
        self._protocol._close()

    def is_closing(self) -> bool:
        return self._protocol._linger_timer is not None or self._transport.is_closing()


class _GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline, a body read only as the app asks, and a
    lingering close.

    The deadline runs from the connection's start, and again from the end of each response,
    until a request's headers are complete (h11 leaves IDLE for the client's side): a client
    that trickles its headers, or opens a connection and sends nothing, is answered 408 and
    closed. uvicorn's own keep-alive timeout still closes an idle kept-alive connection first.
    Once a request's headers are complete, reading pauses until the app first asks for the
    body (uvicorn alone reads on, up to 64 KiB more), so a request that is refused before its
    body is read holds at most one small socket read of it; from then on uvicorn's own flow
    control reads. Closing a connection whose client is still sending lingers (``LINGER_S``):
    the answer reaches the client."""

    header_timeout_s = 20.0
    linger_bytes = 1 << 20

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_left = 0
        self._linger_until = 0.0
        self._linger_idle_s = LINGER_IDLE_S
        self._reading_body = False  # the app has asked for this request's body
        self._raw = transport
        super().connection_made(_LingeringTransport(transport, self))
        self._read_bytes(HEADER_READ_BYTES)
        self._arm_header_timer()

    def _read_bytes(self, n: int) -> None:
        # asyncio's plain socket transport reads max_size per recv (TLS reads its own way).
        if hasattr(type(self._raw), "max_size"):
            self._raw.max_size = n

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:  # the rest of a refused body: dropped
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self._raw.close()
            else:
                self._linger_timer.cancel()
                wait = min(self._linger_idle_s, self._linger_until - self.loop.time())
                self._linger_timer = self.loop.call_later(max(0.0, wait), self._raw.close)
            return
        super().data_received(data)
        self._after_events()

    def _close(self) -> None:
        if self.conn.their_state is h11.SEND_BODY:  # a refused body may still be coming
            self._linger(self.linger_bytes, LINGER_S, quiet_s=LINGER_QUIET_S, idle_s=LINGER_IDLE_S)
        else:
            self._raw.close()

    def _linger(self, nbytes: int, total_s: float, quiet_s: float, idle_s: float) -> None:
        """Close after the answer without a reset: send our FIN, then read and drop what the
        client still sends (after ``quiet_s``; at most ``nbytes``, ``total_s`` in all, ``idle_s``
        without a byte) until it closes its end."""
        raw = self._raw
        if self._linger_timer is not None or raw.is_closing():
            return
        if not raw.can_write_eof():  # TLS: no half-close
            raw.close()
            return
        self._disarm_header_timer()
        raw.write_eof()  # after the answer: the client reads it, then our end of the stream
        self._linger_left, self._linger_idle_s = nbytes, idle_s
        self._linger_until = self.loop.time() + total_s
        if quiet_s > 0:
            raw.pause_reading()
            self._linger_timer = self.loop.call_later(quiet_s, self._drain)
        else:
            self._drain()

    def _drain(self) -> None:
        """The client is still there after the quiet time: read (and drop) what it sends."""
        self._read_bytes(BODY_READ_BYTES)
        self._raw.resume_reading()
        wait = min(self._linger_idle_s, self._linger_until - self.loop.time())
        self._linger_timer = self.loop.call_later(max(0.0, wait), self._raw.close)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            if self.conn.their_state is h11.IDLE:
                self._read_bytes(HEADER_READ_BYTES)
                self._arm_header_timer()
            self._after_events()

    def _after_events(self) -> None:
        if self.conn.their_state is not h11.IDLE and self._header_timer is not None:
            self._disarm_header_timer()  # a new request's headers are in
            self._reading_body = False
        cycle = self.cycle
        if (not self._reading_body and cycle is not None and cycle.more_body and not cycle.response_complete
                and self.conn.their_state is h11.SEND_BODY):
            self.flow.pause_reading()  # until RequestResponseCycle.receive resumes it: _app_reads

    def _app_reads(self) -> None:
        if not self._reading_body and self.conn.their_state is h11.SEND_BODY:
            self._reading_body = True
            self._read_bytes(BODY_READ_BYTES)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.our_state is h11.IDLE:
            self.transport.write(_header_timeout_response(self.header_timeout_s))
        self._linger(HEADER_LINGER_BYTES, HEADER_LINGER_S, quiet_s=0.0, idle_s=HEADER_LINGER_S)


def guarded_protocol(header_timeout_s: float, body_limit: int) -> type[H11Protocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) for this header deadline and
    body limit (a refused body is read and dropped up to it, and no further)."""
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    return type("GuardedH11Protocol", (_GuardedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "linger_bytes": body_limit + LINGER_EXTRA_BYTES})
