"""The HTTP front door's connection layer: uvicorn's h11 protocol with the bounds only a
connection can keep (the request's bounds are ``frontend/http_front.py``'s ``FrontDoor``).

    open connections   at most ``max_connections`` at once; past it 429 + Retry-After at once,
                       before a byte is read (an idle or stalled socket still holds a file
                       descriptor and a read buffer)
    headers            complete within header_timeout_s of the connection opening (or of the
                       last response), else 408 and a short lingering close: uvicorn alone
                       waits for them forever (slowloris)
    the body           read only as the app asks for it: a refused request costs one socket read
    the response       a client that stops reading it (the socket's buffers full) for
                       send_timeout_s is dropped: its request is aborted, its admission slot and
                       body bytes come back (uvicorn alone waits for it forever)
    closing            a refused client still sending its body gets the answer, then a
                       lingering close
"""
from __future__ import annotations

import asyncio
import json
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from frontend import openai_protocol as oai


def _error_response(status: bytes, message: str, code: str, type_: str = "invalid_request_error",
                    retry_ms: int | None = None) -> bytes:
    body = json.dumps(oai.error_json(message, type_, code)).encode()
    hint = b"" if retry_ms is None else b"retry-after: %d\r\nretry-after-ms: %d\r\n" % (-(-retry_ms // 1000), retry_ms)
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\n%scontent-length: %d\r\n\r\n%s"
            % (status, hint, len(body), body))


def _header_timeout_response(timeout_s: float) -> bytes:
    return _error_response(b"408 Request Timeout", f"the request headers did not arrive within {timeout_s:g} s "
                           "(http_header_timeout_s)", "header_timeout")


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
    the answer reaches the client.

    ``limits`` (the server's FrontLimits, shared by its connections) counts the open
    connections and holds the send deadline: the transport pauses our writes when its buffer
    is full (the client reads nothing), and a pause longer than ``send_timeout_s`` aborts the
    connection, which uvicorn reports to the app as the client's disconnect."""

    header_timeout_s = 20.0
    linger_bytes = 1 << 20
    limits = None  # FrontLimits: set by guarded_protocol

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_left = 0
        self._linger_until = 0.0
        self._linger_idle_s = LINGER_IDLE_S
        self._reading_body = False  # the app has asked for this request's body
        self._send_timer: asyncio.TimerHandle | None = None
        self._raw = transport
        super().connection_made(_LingeringTransport(transport, self))
        self._counted = self.limits.connections.try_enter()
        if not self._counted:
            self._refuse_connection()
            return
        self._read_bytes(HEADER_READ_BYTES)
        self._arm_header_timer()

    def _refuse_connection(self) -> None:
        """Past the open connections the server keeps: 429 at once, nothing read, and the
        short lingering close of a header timeout (the client may be sending its request)."""
        lim = self.limits
        lim.count_refusal("http_connections")
        now = time.monotonic()
        lim.retry.refused(now)
        retry = lim.retry.hint_ms(now)
        self._raw.write(_error_response(
            b"429 Too Many Requests", f"the router has {lim.connections.active} HTTP connections open, the most it "
            f"keeps (http_max_connections); retry after {retry} ms", "resource_exhausted", "rate_limit_exceeded",
            retry))
        self._linger(HEADER_LINGER_BYTES, HEADER_LINGER_S, quiet_s=0.0, idle_s=HEADER_LINGER_S)

    def _read_bytes(self, n: int) -> None:
        # asyncio's plain socket transport reads max_size per recv (TLS reads its own way).
        if hasattr(type(self._raw), "max_size"):
            self._raw.max_size = n

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        if self._counted:
            self._counted = False
            self.limits.connections.leave()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_timeout_s, self._send_timeout)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timeout(self) -> None:
        """The client has read nothing of its response for send_timeout_s: no answer can reach
        it, so the connection is aborted (its unsent bytes dropped) rather than closed."""
        self._send_timer = None
        self.limits.count_refusal("send_timeout")
        self._raw.abort()

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


def guarded_protocol(header_timeout_s: float, limits) -> type[H11Protocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) for this header deadline and
    the server's ``limits`` (FrontLimits: the open connections, the send deadline, the body
    limit: a refused body is read and dropped up to it, and no further)."""
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    return type("GuardedH11Protocol", (_GuardedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "limits": limits,
                 "linger_bytes": limits.body_limit + LINGER_EXTRA_BYTES})
