"""The router's HTTP limits over a real uvicorn server and raw sockets: a body over the limit is
413 in OpenAI's shape whether it declares its length or arrives chunked (Transfer-Encoding:
chunked, no Content-Length), and stop strings are bounded in number and length (400 naming
the limit). These refusals come before the orchestrator is asked anything, so the app here is
built over an orchestrator that only holds the configuration."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from router.config import RouterConfig
from router.http_server import HttpServer, build_app
from router.openai_protocol import ChatCompletionRequest
from tokens.sampling_params import SamplingParamError, SamplingParams

LIMIT = 64 * 1024


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def with_server(fn):
    cfg = RouterConfig(redis_url="redis://unused", model_name="m", tokenizer_dir="unused", max_model_len=64,
                       max_message_bytes=LIMIT)
    server = HttpServer(build_app(SimpleNamespace(config=cfg, tokenizer=None)), "127.0.0.1", 0)
    address = await server.start()
    try:
        host, port = address.rsplit(":", 1)
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
    assert f"at most {LIMIT} are accepted (max_message_bytes)" in err["message"]


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
