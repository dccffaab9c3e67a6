"""`pdserve bench load --http`'s verdict against routers that cheat: tiny HTTP servers on
127.0.0.1 (http.server in a thread), loaded by the bench's own load process for 1.5 s per level
(about 3 s a test). A router that answers 429 to everything, one that 429s everything once
overloaded, and 200s with an empty, cut, malformed or short body must all fail; an honest one
passes."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import load_check
from bench.load_http_client import MAX_TOKENS, dechunk, request_body, run_load

ADMITTED = 2  # the fake router "admits" 2 at once: 2 clients at 1x, 4 at 2x, 8 at 4x
SECONDS = 1.5  # the clients start spread over the first second
BODY_BYTES = 1024


def completion(tokens: int = MAX_TOKENS, finish: str = "length") -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}}


class FakeRouter(BaseHTTPRequestHandler):
    """Reads the whole body, then answers as ``server.mode`` says."""

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        srv = self.server
        with srv.lock:
            srv.inflight += 1
            srv.collapsed |= srv.mode == "collapse" and srv.inflight > ADMITTED
            refuse = srv.mode == "429" or srv.collapsed
        if not refuse:
            time.sleep(0.01)  # a served request takes a while: the rate is bound by it, not the CPU
        with srv.lock:  # before the answer: a client's next request cannot overlap its last one
            srv.inflight -= 1
        if refuse:
            self._send(429, json.dumps({"error": {"message": "overloaded"}}).encode(), {"retry-after-ms": "20"})
        else:
            self._send(200, *self._answer(srv.mode))

    def _answer(self, mode: str) -> tuple[bytes, dict]:
        if mode == "empty":
            return b"", {}
        if mode == "malformed":
            return b'{"object": "text_completion", "choi', {}
        if mode == "short":  # one token where four were asked for with ignore_eos
            return json.dumps(completion(tokens=1)).encode(), {}
        if mode == "cut":  # a Content-Length the body never reaches
            return json.dumps(completion()).encode()[:20], {"Content-Length": "500"}
        return json.dumps(completion()).encode(), {}

    def _send(self, status: int, body: bytes, headers: dict) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def fake_router():
    servers = []

    def start(mode: str) -> str:
        srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeRouter)
        srv.daemon_threads = True
        srv.mode, srv.lock, srv.inflight, srv.collapsed = mode, threading.Lock(), 0, False
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(srv)
        return f"127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def bench_verdict(url: str, overload: float = 2.0) -> tuple[dict, dict, dict]:
    """The bench's two levels against ``url`` (1x first), then its verdict."""
    levels = []
    for level in (1.0, overload):
        clients = max(1, round(level * ADMITTED))
        out = run_load(url, clients, SECONDS, BODY_BYTES, too_large_every=0, request_timeout=10, seed=0)
        levels.append(load_check.level_figures(out, clients, SECONDS))
    return (*levels, load_check.verdict(*levels, within_bound=True))


def test_an_honest_router_passes(fake_router):
    at_1x, over, v = bench_verdict(fake_router("good"))
    assert v["passed"], (v, at_1x, over)
    assert at_1x["done"] > 0 and over["done"] > 0 and at_1x["bad_200"] == over["bad_200"] == 0
    assert v["done_ratio_vs_1x"] >= load_check.DONE_RATIO_MIN
    assert over["answered"] == over["requests"] == over["done"]


def test_a_router_that_answers_429_to_everything_fails(fake_router):
    at_1x, over, v = bench_verdict(fake_router("429"))
    assert at_1x["rejected_429"] > 0 and over["rejected_429"] > 0
    assert at_1x["errors"] == over["errors"] == 0  # every request answered: not what fails it
    assert v["done_per_s_at_1x"] == 0 and v["done_ratio_vs_1x"] is None
    assert not v["checks"]["done_ratio_vs_1x"] and not v["passed"]


def test_a_router_that_429s_everything_once_overloaded_fails(fake_router):
    # 4x: 8 clients, the third of them starting 0.24 s in (their seeds' start offsets), so the
    # collapse comes early in the window and the ratio is far below the bound.
    at_1x, over, v = bench_verdict(fake_router("collapse"), overload=4.0)
    assert at_1x["done"] > 0 and at_1x["rejected_429"] == 0
    assert over["rejected_429"] > 0 and v["done_ratio_vs_1x"] < load_check.DONE_RATIO_MIN
    assert v["checks"] == {"errors": True, "bad_200": True, "within_bound": True, "done_ratio_vs_1x": False}
    assert not v["passed"]


@pytest.mark.parametrize("mode", ["empty", "malformed", "short", "cut"])
def test_a_200_without_the_completion_asked_for_is_bad(fake_router, mode):
    at_1x, over, v = bench_verdict(fake_router(mode))
    assert at_1x["bad_200"] > 0 and over["bad_200"] > 0
    assert at_1x["done"] == over["done"] == 0 and at_1x["status"]["200"] == at_1x["bad_200"]
    assert not v["checks"]["bad_200"] and not v["passed"]


def test_check_completion_names_what_is_wrong():
    good = completion()
    assert load_check.check_completion(json.dumps(good).encode(), MAX_TOKENS) is None
    cases = {
        b"": "not JSON", b"[]": "not a JSON object", b"\xff": "not JSON",
        json.dumps({**good, "object": "chat.completion"}).encode(): "not 'text_completion'",
        json.dumps({**good, "choices": []}).encode(): "not exactly one choice",
        json.dumps({**good, "usage": None}).encode(): "no usage counts",
        json.dumps({**good, "usage": {**good["usage"], "completion_tokens": True}}).encode(): "no usage counts",
        json.dumps(completion(tokens=3)).encode(): "3 completion tokens, 4 asked for",
        json.dumps(completion(finish="stop")).encode(): "finish_reason 'stop'",
        json.dumps({**good, "usage": {**good["usage"], "total_tokens": 1}}).encode(): "do not add up",
    }
    for body, why in cases.items():
        assert why in (load_check.check_completion(body, MAX_TOKENS) or ""), body


def test_verdict_ratio_and_checks():
    def level(done_per_s: float, errors: int = 0, bad: int = 0) -> dict:
        return {"done_per_s": done_per_s, "errors": errors, "bad_200": bad}

    v = load_check.verdict(level(10.0), level(8.0), within_bound=True)
    assert v["done_ratio_vs_1x"] == 0.8 and v["passed"]
    v = load_check.verdict(level(10.0), level(7.9), within_bound=True)
    assert not v["checks"]["done_ratio_vs_1x"] and not v["passed"]
    assert not load_check.verdict(level(10.0), level(10.0, errors=1), within_bound=True)["passed"]
    assert not load_check.verdict(level(10.0, bad=1), level(10.0), within_bound=True)["passed"]
    assert not load_check.verdict(level(10.0), level(10.0), within_bound=False)["passed"]


def test_request_body_size_and_dechunk():
    body = request_body(BODY_BYTES)
    assert len(body) == BODY_BYTES
    assert json.loads(body)["max_tokens"] == MAX_TOKENS and json.loads(body)["ignore_eos"] is True
    assert dechunk(b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n") == b"abcde"
    assert dechunk(b"3\r\nabc\r\n") is None and dechunk(b"zz\r\n") is None
