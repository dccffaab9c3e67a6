"""The load process of `pdserve bench load --http` (``python -m bench.load_http_client``):
closed-loop clients, each sending POST /v1/completions with a body of a given size on a
connection of its own, reading the answer while it sends; one JSON line at the end.

Every 200's body is read to its end and checked (bench/load_check.py): a well-formed
``text_completion`` with exactly the tokens asked for (the request sets ``ignore_eos``). One
that is not counts in ``bad_200``, not in ``done``. A 429 waits its ``retry-after-ms`` (x
0.5-1.5), as the official client does; everything else sends again at once.

    requests        requests sent
    status          answers by HTTP status (200s good or bad)
    lost            no answer: refused connection, a connection cut before the status line,
                    no answer in --request-timeout
    bad_200         200s whose body was cut short, malformed or short of tokens
    done_in_window  good 200s answered before the clients stopped sending (--seconds): the
                    count behind ``done_per_s``
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time

from bench.load_check import MAX_TOKENS, check_completion

WRITE_CHUNK = 256 * 1024
SAMPLES = 5  # first failures of each kind kept for the report


def request_body(size: int) -> bytes:
    """A valid completions request of exactly ``size`` bytes, asking for ``MAX_TOKENS`` tokens
    whatever the model samples (``ignore_eos``: the answer's count is exact)."""
    base = {"model": "", "prompt": "The capital of France is", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "user": ""}
    body = json.dumps(base).encode()
    if len(body) > size:
        raise ValueError(f"a body of {size} bytes cannot hold the request ({len(body)} bytes)")
    return body.replace(b'"user": ""', b'"user": "' + b"u" * (size - len(body)) + b'"')


def dechunk(data: bytes) -> bytes | None:
    """The payload of a complete chunked transfer coding; None while the last chunk is missing
    (or the framing is broken: the caller then sees the body cut short)."""
    out, pos = bytearray(), 0
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            size = int(data[pos:eol].split(b";", 1)[0], 16)
        except ValueError:
            return None
        if size == 0:
            return bytes(out)
        if len(data) < eol + 2 + size + 2:
            return None
        out += data[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2


class _Exchange(asyncio.Protocol):
    """One request on its own connection. The status line and headers are kept as soon as they
    come; the answer is complete when its body is (Content-Length, chunked, or the connection's
    close when it has neither), and kept whatever happens to the socket afterwards (a server
    that answers before reading the body may reset the connection)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.buf = bytearray()
        self.done = loop.create_future()
        self.writable = asyncio.Event()
        self.writable.set()
        self.transport = None
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.body_at: int | None = None  # offset of the body in buf, once the headers are in
        self.body: bytes | None = None  # the whole body, once complete

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.done.done():
            return
        if self.body_at is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            self.headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
            self.status, self.body_at = int(lines[0].split(" ", 2)[1]), end + 4
        self._complete(closed=False)

    def _complete(self, closed: bool) -> None:
        body = bytes(self.buf[self.body_at:])
        if "content-length" in self.headers:
            n = int(self.headers["content-length"])
            self.body = body[:n] if len(body) >= n else None
        elif "chunked" in self.headers.get("transfer-encoding", ""):
            self.body = dechunk(body)
        elif closed:
            self.body = body
        if self.body is not None:
            self.done.set_result(True)

    def connection_lost(self, exc) -> None:
        self.writable.set()
        if not self.done.done():
            if self.body_at is not None:
                self._complete(closed=True)
            if not self.done.done():
                self.done.set_result(False)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()


class ClientStats:
    def __init__(self) -> None:
        self.status: dict[int, int] = {}
        self.lost = 0
        self.bad_200 = 0
        self.done_in_window = 0
        self.samples: list[str] = []
        self.bad_samples: list[str] = []

    def error(self, what: str) -> None:
        self.lost += 1
        if len(self.samples) < SAMPLES:
            self.samples.append(what[:300])

    def bad(self, why: str, body: bytes | None) -> None:
        self.bad_200 += 1
        if len(self.bad_samples) < SAMPLES:
            self.bad_samples.append(f"{why}: {(body or b'')[:200]!r}")

    def answered(self, ex: _Exchange, stop_at: float) -> None:
        """Count a complete answer; a 200 only once its body is checked."""
        self.status[ex.status] = self.status.get(ex.status, 0) + 1
        if ex.status == 200:
            why = check_completion(ex.body, MAX_TOKENS)
            if why is not None:
                self.bad(why, ex.body)
            elif time.monotonic() <= stop_at:
                self.done_in_window += 1
        elif ex.status not in (413, 429) and len(self.samples) < SAMPLES:
            self.samples.append(f"HTTP {ex.status}: {bytes(ex.buf[-300:])!r}")


async def _one(host: str, port: int, head: bytes, body: memoryview, timeout: float, stop_at: float,
               stats: ClientStats) -> _Exchange | None:
    """One request; returns its exchange, or None when it got no complete answer."""
    loop = asyncio.get_running_loop()
    try:
        _, ex = await asyncio.wait_for(loop.create_connection(lambda: _Exchange(loop), host, port), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        stats.error(f"connect: {type(e).__name__}: {e}")
        return None
    try:
        ex.transport.write(head)
        for off in range(0, len(body), WRITE_CHUNK):
            await ex.writable.wait()
            if ex.done.done() or ex.transport.is_closing():
                break  # answered (or cut off) before the body was all sent: the server refused it
            ex.transport.write(body[off:off + WRITE_CHUNK])
        await asyncio.wait_for(asyncio.shield(ex.done), timeout)
    except asyncio.TimeoutError:
        stats.error(f"no answer in {timeout:g} s")
        return None
    finally:
        if not ex.transport.is_closing():
            ex.transport.abort()  # what is left of the body is not sent: close() would send it first
    if ex.body is None:
        if ex.status == 200:  # a 200 whose body never came whole: a bad answer, not a lost one
            stats.status[200] = stats.status.get(200, 0) + 1
            stats.bad(f"the body was cut short ({len(ex.buf) - ex.body_at} bytes came)", bytes(ex.buf[ex.body_at:]))
        else:
            stats.error(f"the connection closed without an answer ({len(ex.buf)} bytes came)")
        return None
    stats.answered(ex, stop_at)
    return ex


async def _client(host: str, port: int, body: memoryview, too_large_every: int, stop_at: float, timeout: float,
                  seed: int, stats: ClientStats, counter: list[int]) -> None:
    body_bytes = len(body) - 1
    rng = random.Random(seed)
    await asyncio.sleep(rng.random())  # the clients start spread over a second, not in one burst
    while time.monotonic() < stop_at:
        counter[0] += 1
        size = body_bytes + 1 if too_large_every and counter[0] % too_large_every == 0 else body_bytes
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {size}\r\nConnection: close\r\n\r\n").encode()
        ex = await _one(host, port, head, body[:size], timeout, stop_at, stats)
        if ex is not None and ex.status == 429:
            wait_ms = int(ex.headers.get("retry-after-ms", "1000"))
            await asyncio.sleep(min(wait_ms / 1000 * (0.5 + rng.random()), max(0.0, stop_at - time.monotonic())))


async def _client_main(a: argparse.Namespace) -> dict:
    host, port = a.url.rsplit(":", 1)
    stats, counter = ClientStats(), [0]
    # Built once, before the clock starts: each client building its own (a JSON dump of a body of
    # up to a few MB) took the first part of the window from the load at high client counts.
    body = memoryview(request_body(a.body_bytes) + b" ")  # one byte more: the over-limit body (413)
    stop_at = time.monotonic() + a.seconds
    await asyncio.gather(*(_client(host, int(port), body, a.too_large_every, stop_at, a.request_timeout,
                                   a.seed + i, stats, counter) for i in range(a.clients)))
    return {"requests": counter[0], "status": stats.status, "lost": stats.lost, "bad_200": stats.bad_200,
            "done_in_window": stats.done_in_window, "samples": stats.samples, "bad_samples": stats.bad_samples}


def client_main(argv: list[str] | None = None) -> int:
    """``python -m bench.load_http_client``: the load, in a process of its own; one JSON line."""
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--body-bytes", type=int, required=True)
    p.add_argument("--too-large-every", type=int, default=10)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    print(json.dumps(asyncio.run(_client_main(p.parse_args(argv)))), flush=True)
    return 0


def run_load(url: str, clients: int, seconds: float, body_bytes: int, too_large_every: int,
             request_timeout: float, seed: int) -> dict:
    """One level of load against ``url`` (host:port), in a process of its own; its JSON line."""
    load = subprocess.run(
        [sys.executable, "-m", "bench.load_http_client", "--url", url, "--clients", str(clients),
         "--seconds", str(seconds), "--body-bytes", str(body_bytes), "--too-large-every", str(too_large_every),
         "--request-timeout", str(request_timeout), "--seed", str(seed)],
        capture_output=True, text=True, timeout=seconds + 2 * request_timeout + 120)
    if load.returncode != 0:
        raise RuntimeError(f"the load process failed: {load.stderr[-2000:]}")
    return json.loads(load.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(client_main())
