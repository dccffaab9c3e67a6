"""The router's HTTP limits over a real uvicorn server and raw sockets: a body over the limit is
413 in OpenAI's shape whether it declares its length or arrives chunked (Transfer-Encoding:
chunked, no Content-Length); past the admitted requests, or past the byte budget, 429 in
OpenAI's shape with Retry-After, the body unread; headers or a body that trickle in are cut
off (408) within their timeouts; stop strings are bounded in number and length and an unknown
chat role is refused (400 naming the limit). These refusals come before the orchestrator is
asked anything, so the app here is built over an orchestrator that only holds the
configuration: a request that passes them reaches a route that fails (it has no orchestrator
to call), which is the unexpected exception the API must still answer as JSON."""
from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import pytest

from frontend.http_budget import body_shape
from frontend.http_server import HttpServer, build_app
from frontend.openai_protocol import ChatCompletionRequest
from router.config import RouterConfig
from tokens.sampling_params import SamplingParamError, SamplingParams

LIMIT = 64 * 1024


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def with_server(fn, **fields):
    """``fn(host, port)`` against a server of RouterConfig ``fields``; ``fn(host, port, app)``
    if it takes three arguments (to read the front door's counters)."""
    fields.setdefault("max_body_bytes", LIMIT)
    cfg = RouterConfig(redis_url="redis://unused", model_name="m", tokenizer_dir="unused", max_model_len=64,
                       **fields)
    app = build_app(SimpleNamespace(config=cfg, tokenizer=None))
    server = HttpServer(app, "127.0.0.1", 0, header_timeout_s=cfg.http_header_timeout_s)
    address = await server.start()
    try:
        host, port = address.rsplit(":", 1)
        if fn.__code__.co_argcount == 3:
            return await fn(host, int(port), app)
        return await fn(host, int(port))
    finally:
        await server.stop()


async def exchange(host: str, port: int, head: bytes, body_parts: list[bytes]) -> tuple[int, dict]:
    """Send ``head`` and then each part; read the response (status, JSON body)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head)
        for part in body_parts:
            writer.write(part)
            await writer.drain()
        raw = await reader.read()  # the server closes after its answer ("Connection: close")
    finally:
        writer.close()
    header, _, body = raw.partition(b"\r\n\r\n")
    status = int(header.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in header.lower():
        body = dechunk(body)
    return status, json.loads(body)


def dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out, data = out + data[:size], data[size + 2:]


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def chunked_head(path: str = "/v1/chat/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()


def test_a_chunked_body_over_the_limit_is_413_naming_the_limit():
    # 8 KiB chunks of a JSON string that never ends: the server must answer once the limit is
    # passed, not read (and hold) on until the client stops. The last part sent is the one that
    # crosses the limit (nothing is written after the answer, which the server may follow by
    # closing), and no terminating chunk comes: without the count the read would never end.
    part = chunk(b"x" * 8192)
    parts = [chunk(b'{"model": "m", "messages": [{"role": "user", "content": "')] + [part] * (LIMIT // 8192)

    async def go(host, port):
        return await exchange(host, port, chunked_head(), parts)

    status, body = run(with_server(go))
    assert status == 413, body
    err = body["error"]
    assert err["code"] == "body_too_large" and err["type"] == "invalid_request_error"
    assert f"at most {LIMIT} are accepted (max_body_bytes)" in err["message"]


def test_a_declared_length_over_the_limit_is_413_before_reading():
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {LIMIT + 1}\r\nConnection: close\r\n\r\n").encode()

    async def go(host, port):
        return await exchange(host, port, head, [])  # not one byte of the body sent

    status, body = run(with_server(go))
    assert status == 413 and f"has {LIMIT + 1} bytes; at most {LIMIT}" in body["error"]["message"]


def test_a_chunked_body_under_the_limit_reaches_the_api():
    """Chunked bodies are still served: split anywhere, parsed whole, validated as usual."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "stop": ["s" * 257]}).encode()
    parts = [chunk(body[:7]), chunk(body[7:30]), chunk(body[30:]), b"0\r\n\r\n"]

    async def go(host, port):
        return await exchange(host, port, chunked_head(), parts)

    status, resp = run(with_server(go))
    assert status == 400, resp
    assert "at most 256 characters" in resp["error"]["message"] and resp["error"]["param"] == "stop"


@pytest.mark.parametrize("stop, words", [
    (["x"] * 17, "at most 16 stop sequences, got 17"),
    ("y" * 257, "at most 256 characters, got one of 257"),
    (["ok", "z" * 300], "at most 256 characters, got one of 300"),
])
def test_stop_limits_over_http(stop, words):
    with pytest.raises(ValueError, match=words):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stop=stop)
    ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stop=["a" * 256] * 16)


def test_stop_limits_in_the_sampling_parameters():
    """What gRPC requests (and anything else building SamplingParams) are checked against."""
    SamplingParams(stop=("a" * 256,) * 16).validate()
    with pytest.raises(SamplingParamError, match=r"at most 256 characters; stop\[1\] has 257") as e:
        SamplingParams(stop=("ok", "b" * 257)).validate()
    assert e.value.field == "stop"
    with pytest.raises(SamplingParamError, match="at most 16 strings, got 17"):
        SamplingParams(stop=("c",) * 17).validate()


# -- admission, byte budget, timeouts -------------------------------------------------------------
def post_head(length: int, path: str = "/v1/chat/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def chat_body(size: int, role: str = "user") -> bytes:
    """A valid chat request of exactly ``size`` bytes (JSON whitespace pads it)."""
    body = json.dumps({"model": "m", "messages": [{"role": role, "content": "hi"}], "max_tokens": 2}).encode()
    assert len(body) <= size
    return body[:-1] + b" " * (size - len(body)) + b"}"


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict, dict]:
    """One response: status, headers (lower-case names), JSON body."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
    body = await reader.readexactly(int(headers["content-length"]))
    return int(lines[0].split(" ", 2)[1]), headers, json.loads(body)


async def until(cond, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_past_the_admitted_requests_429_in_openai_shape_and_probes_still_answer():
    # max_inflight 1: the front admits rpc_limit = 2 * 1 + 64 = 66 requests at once. 66
    # connections each send headers and a few bytes of their body, and wait: held, admitted.
    async def go(host, port, app):
        front = app.state.front
        held = []
        try:
            for _ in range(front.admission.limit):
                r, w = await asyncio.open_connection(host, port)
                w.write(post_head(1000) + b'{"mod')
                held.append((r, w))
            await until(lambda: front.admission.active == front.admission.limit)
            r, w = await asyncio.open_connection(host, port)
            w.write(post_head(1000) + chat_body(1000))
            status, headers, body = await read_response(r)
            assert await r.read() == b""  # and the connection is closed (its body was not read)
            w.close()
            r, w = await asyncio.open_connection(host, port)  # the liveness probe is not counted
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            probe = await read_response(r)
            w.close()
        finally:
            for _, hw in held:
                hw.close()
        await until(lambda: front.admission.active == 0)  # each one left when its client did
        return status, headers, body, probe, dict(front.refused)

    status, headers, body, probe, refused = run(with_server(go, max_inflight=1))
    # The hint grows with the refusals against the requests that left (none yet): RetryHint.
    hint_ms = int(headers["retry-after-ms"])
    assert status == 429 and hint_ms >= 200 and headers["retry-after"] == str(math.ceil(hint_ms / 1000))
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    err = body["error"]
    assert err["type"] == "rate_limit_exceeded" and err["code"] == "resource_exhausted"
    assert f"66 HTTP requests in flight, the most this router admits at once; retry after {hint_ms} ms" \
        in err["message"]
    assert probe[0] == 200 and probe[2] == {"status": "ok"}
    assert refused == {"http_overloaded": 1}


def test_a_body_past_the_byte_budget_is_429_unread_and_the_bytes_come_back():
    # Room for one 60,000-byte body at a time: the second is refused on its Content-Length.
    async def go(host, port, app):
        budget = app.state.front.budget
        body = chat_body(60_000)
        ra, wa = await asyncio.open_connection(host, port)
        wa.write(post_head(len(body)) + body[:100])
        await until(lambda: budget.held == 60_000)
        rb, wb = await asyncio.open_connection(host, port)
        wb.write(post_head(len(body)))  # not one byte of the body
        refused = await read_response(rb)
        wb.close()
        wa.write(body[100:])
        served = await read_response(ra)  # the route fails: this orchestrator cannot generate
        wa.close()
        await until(lambda: budget.held == 0)
        return refused, served, budget.peak

    refused, served, peak = run(with_server(go, max_buffered_bytes=100_000))
    status, headers, body = refused
    assert status == 429 and int(headers["retry-after-ms"]) >= 200 and headers["connection"] == "close"
    assert ("holds 60000 bytes of request bodies and cannot take 60000 more (max_buffered_bytes 100000)"
            in body["error"]["message"]) and body["error"]["code"] == "resource_exhausted"
    assert peak == 60_000 + body_shape(chat_body(60_000)).parsed_bytes  # its bytes, then what parsing makes
    # An unexpected exception in a route is a 500 in OpenAI's shape, not uvicorn's plain text.
    status, headers, body = served
    assert status == 500 and headers["content-type"] == "application/json"
    assert body["error"]["type"] == "internal_error" and "AttributeError" in body["error"]["message"]


async def trickle(host: str, port: int, prefix: bytes, data: bytes, every_s: float) -> tuple[float, bytes]:
    """Send ``prefix`` at once, then ``data`` a byte at a time, ``every_s`` apart, until the
    server closes the connection; returns (seconds until it closed, what it answered)."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(prefix)
    t0 = loop.time()

    async def send():
        for i in range(len(data)):
            writer.write(data[i:i + 1])
            await asyncio.sleep(every_s)
        await asyncio.sleep(3600)  # all sent: wait to be cut off

    sender = asyncio.ensure_future(send())
    try:
        answer = await asyncio.wait_for(reader.read(), timeout=20)  # EOF: the server closed it
        return loop.time() - t0, answer
    finally:
        sender.cancel()
        writer.close()


@pytest.mark.parametrize("what", ["headers", "nothing", "body", "next_headers"])
def test_slow_clients_are_cut_off_within_the_timeouts(what):
    """Slowloris over a real socket: headers a byte every 50 ms (never complete within the 0.5 s
    allowed), a connection that sends nothing, a body a byte every 50 ms, and the headers of a
    kept-alive connection's second request. Each is answered 408 and closed; the bound is
    asserted with slack for a shared machine."""
    head = post_head(400)
    probe = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    prefix, data = {"headers": (b"", head), "nothing": (b"", b""), "body": (head, chat_body(400)),
                    "next_headers": (probe, head)}[what]

    async def go(host, port):
        return await trickle(host, port, prefix, data, 0.05)

    took, answer = run(with_server(go, http_header_timeout_s=0.5, http_body_timeout_s=0.5))
    assert 0.4 < took < 5.0, took
    if what == "next_headers":  # the first request was answered, then the deadline ran again
        assert answer.startswith(b"HTTP/1.1 200 OK"), answer
        answer = answer[answer.index(b"HTTP/1.1 408"):]
    status_line, _, body = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), answer
    code = "body_timeout" if what == "body" else "header_timeout"
    assert json.loads(body.partition(b"\r\n\r\n")[2])["error"]["code"] == code


@pytest.mark.parametrize("what", ["headers", "next_headers"])
def test_a_client_still_writing_headers_after_the_408_gets_no_reset(what):
    """The race behind a slowloris test's rare reset (CI, once): a header byte that arrives as
    the 408 goes out. A socket closed outright answers it with a reset, and a reset that comes
    before the client has read the 408 loses it (asyncio's read() raises). So after the 408 the
    server half-closes and reads and drops what still comes: a client that goes on writing
    after reading the 408 and EOF sees no reset at first (here 4 bytes over 0.2 s; closed
    outright, the second write fails), and is cut off within the bound
    (``HEADER_LINGER_S``, asserted with slack)."""
    head = post_head(400)
    prefix = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" if what == "next_headers" else b""

    async def go(host, port):
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(prefix + head[:10])
            answer = await asyncio.wait_for(reader.read(), timeout=10)  # the 408, then EOF
            t0, sent = loop.time(), 0
            try:
                while loop.time() - t0 < 10:
                    writer.write(b"x")
                    await writer.drain()
                    sent += 1
                    await asyncio.sleep(0.05)
            except (ConnectionResetError, BrokenPipeError):
                return answer, sent, loop.time() - t0
            return answer, sent, None
        finally:
            writer.close()

    answer, sent, cut_after = run(with_server(go, http_header_timeout_s=0.5))
    assert b"HTTP/1.1 408" in answer and answer.rstrip().endswith(b"}"), answer
    assert sent >= 4, sent
    assert cut_after is not None and cut_after < 2.0 + 5.0, (sent, cut_after)


def test_an_unknown_chat_role_is_400_naming_the_role_and_the_roles():
    body = chat_body(300, role="wizard")

    async def go(host, port):
        return await exchange(host, port, post_head(len(body)).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"),
                              [body])

    status, resp = run(with_server(go))
    err = resp["error"]
    assert status == 400 and err["param"] == "messages.0.role", resp
    assert "unknown role 'wizard'; the roles are system, user, assistant, tool, developer" in err["message"]
    for role in ("system", "user", "assistant", "tool", "developer"):
        ChatCompletionRequest(model="m", messages=[{"role": role, "content": "hi"}])


def test_a_refused_client_still_sending_its_body_reads_the_answer():
    """The 429 comes before the body is read; a client that writes its whole body before
    reading (as most do) must still get it, not a reset: the server lingers, reading and
    dropping the rest, after its answer. 6 MiB is more than loopback's socket buffers hold."""
    size = 6 << 20

    async def go(host, port, app):
        budget = app.state.front.budget
        ra, wa = await asyncio.open_connection(host, port)
        wa.write(post_head(size) + b'{"model": "m"')  # holds the budget, never finishes
        await until(lambda: budget.held == size)
        rb, wb = await asyncio.open_connection(host, port)
        wb.write(post_head(size))
        chunk = b" " * (64 << 10)
        for _ in range(size // len(chunk)):  # raises on a reset
            wb.write(chunk)
            await wb.drain()
        answer = await read_response(rb)
        wb.close()
        wa.close()
        await until(lambda: budget.held == 0)
        return answer

    status, headers, body = run(with_server(go, max_body_bytes=8 << 20, max_buffered_bytes=10 << 20))
    assert status == 429 and body["error"]["code"] == "resource_exhausted", body
