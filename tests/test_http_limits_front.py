"""The HTTP front door's bounds added for issue 49, over a real uvicorn server and raw sockets:
open connections are capped (429 before a byte is read), requests that stall half-sent are
dropped by their deadlines and give their connection back, a client that stops reading its
stream is dropped and its request aborted, a body nested too deep is a 400 naming the depth
limit, and what a body becomes once parsed is counted in the byte budget.

The orchestrator is a stand-in holding the configuration (these bounds act before it is asked
anything) and, for the stalled reader, a stream that never ends: the fault itself (a socket
that reads nothing) is real."""
from __future__ import annotations

import asyncio
import json
import socket
from types import SimpleNamespace

from frontend.http_budget import MAX_BODY_DEPTH, PARSED_VALUE_BYTES, body_shape
from frontend.http_server import HttpServer, build_app
from protos.pdserve.v1 import serving_pb2 as pb
from router.config import RouterConfig
from tests.test_http_limits import read_response, until


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def with_server(fn, orch_fields=None, **fields):
    """``fn(host, port, app)`` against a server of RouterConfig ``fields``."""
    fields.setdefault("max_body_bytes", 64 * 1024)
    cfg = RouterConfig(redis_url="redis://unused", model_name="m", tokenizer_dir="unused", max_model_len=64,
                       **fields)
    app = build_app(SimpleNamespace(config=cfg, tokenizer=None, **(orch_fields or {})))
    server = HttpServer(app, "127.0.0.1", 0, header_timeout_s=cfg.http_header_timeout_s)
    host, port = (await server.start()).rsplit(":", 1)
    try:
        return await fn(host, int(port), app)
    finally:
        await server.stop()


def head(length: int, path: str = "/v1/chat/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_connections_past_the_cap_are_refused_and_stalled_requests_give_theirs_back():
    """Four connections (the cap) each send half a request and stop: two half their headers,
    two their headers and half the body. A fifth is answered 429 at once, naming the cap, with a
    retry hint; the four are answered 408 by their deadlines and closed, and then a new
    connection is served."""
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    halves = [head(len(body))[:20], head(len(body))[:30], head(len(body)) + body[:10], head(len(body)) + body[:20]]

    async def go(host, port, app):
        conns = app.state.front.connections
        stalled = []
        for half in halves:
            r, w = await asyncio.open_connection(host, port)
            w.write(half)
            stalled.append((r, w))
        await until(lambda: conns.active == 4)
        r, w = await asyncio.open_connection(host, port)
        refused = await read_response(r)
        w.close()
        answers = [await asyncio.wait_for(sr.read(), 10) for sr, _ in stalled]  # read to EOF: closed
        for _, sw in stalled:
            sw.close()
        await until(lambda: conns.active == 0)
        r, w = await asyncio.open_connection(host, port)
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        served = await read_response(r)
        w.close()
        return refused, answers, served, dict(app.state.front.refused), conns.peak

    refused, answers, served, counts, peak = run(with_server(
        go, http_max_connections=4, http_header_timeout_s=0.5, http_body_timeout_s=0.5))
    status, headers, err = refused
    hint = int(headers["retry-after-ms"])
    assert status == 429 and hint >= 200 and headers["connection"] == "close"
    assert err["error"]["type"] == "rate_limit_exceeded" and err["error"]["code"] == "resource_exhausted"
    assert (f"the router has 4 HTTP connections open, the most it keeps (http_max_connections); retry after "
            f"{hint} ms") == err["error"]["message"]
    codes = sorted(json.loads(a.partition(b"\r\n\r\n")[2])["error"]["code"] for a in answers)
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers) and codes == ["body_timeout"] * 2 + ["header_timeout"] * 2
    assert served[0] == 200 and peak == 4
    assert counts == {"http_connections": 1, "body_timeout": 2}  # header timeouts are the connection's own


def test_a_client_that_stops_reading_its_stream_is_dropped_and_its_request_aborted():
    """A streaming chat whose client reads nothing (a small receive buffer, never read): once the
    socket's buffers are full the server waits http_send_timeout_s, then drops the connection;
    the request is aborted (its decode stream freed) and its admission slot comes back."""
    aborted = []

    async def generate(greq, **_):
        chunk = pb.GenerateResponse(request_id=greq.request_id, chunk=pb.Chunk(index=0, text="x" * 16384))
        while True:  # a long answer: far more than any socket buffer
            yield chunk
            await asyncio.sleep(0)

    async def abort(rid):
        aborted.append(rid)

    async def go(host, port, app):
        front = app.state.front
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
        await asyncio.get_running_loop().sock_sendall(
            sock, head(len(body)).replace(b"\r\n\r\n", b"\r\nx-request-id: stalled\r\n\r\n") + body)
        await until(lambda: front.refused.get("send_timeout") == 1, timeout=15)
        await until(lambda: aborted and front.admission.active == 0 and front.connections.active == 0)
        sock.close()
        return aborted

    assert run(with_server(go, {"generate": generate, "abort": abort}, http_send_timeout_s=0.5)) == ["stalled"]


def test_a_deeply_nested_body_is_400_naming_the_depth_limit():
    """A tool call's arguments nested 5000 deep (json.loads would raise RecursionError) through
    the real front door: 400 in OpenAI's shape naming the limit, before anything parses it."""
    args = "[" * 5000 + "]" * 5000
    body = ('{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", '
            '"function": {"name": "f", "arguments": %s}}]}]}' % args).encode()

    async def go(host, port, app):
        r, w = await asyncio.open_connection(host, port)
        w.write(head(len(body)) + body)
        answer = await read_response(r)
        w.close()
        return answer

    status, _, err = run(with_server(go))
    assert status == 400 and err["error"]["code"] == "json_too_deep"
    assert err["error"]["message"] == (f"the request body nests JSON 5006 levels deep; at most {MAX_BODY_DEPTH} are "
                                       "accepted (the JSON depth limit)")


def test_what_a_body_becomes_once_parsed_is_counted_in_the_byte_budget():
    """60 KB of empty objects is 20,000 values, ~3 MB once parsed: past a 1 MB budget it is 413
    (it can never fit), and nothing stays held."""
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "x": [{}] * 15_000}).encode()

    async def go(host, port, app):
        r, w = await asyncio.open_connection(host, port)
        w.write(head(len(body)) + body)
        answer = await read_response(r)
        w.close()
        await until(lambda: app.state.front.budget.held == 0)
        return answer

    status, _, err = run(with_server(go, max_buffered_bytes=1 << 20))
    assert status == 413 and err["error"]["code"] == "body_too_large"
    values = body_shape(body).values
    assert values >= 30_000  # each "{}" a value, each "," another
    assert f"hold {values} JSON values, about {values * PARSED_VALUE_BYTES} bytes once parsed" in err["error"]["message"]
    assert "max_buffered_bytes (1048576)" in err["error"]["message"]
