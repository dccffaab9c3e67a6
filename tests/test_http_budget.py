"""The HTTP front's bounds as plain data (frontend/http_budget.py): the body limit a context
implies, the byte budget across requests, the admission count. No server, no sockets."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from frontend.http_budget import (
    BASE_JSON_BYTES,
    MESSAGE_JSON_BYTES,
    MIN_BODY_BYTES,
    Admission,
    ByteBudget,
    RetryHint,
    body_limit_bytes,
)
from frontend.http_front import front_limits
from router.config import RouterConfig


def test_body_limit_follows_the_context_with_a_floor():
    # SmolLM2: 8192 tokens, its longest token is 82 bytes of JSON ("\n" + 80 spaces, escaped).
    assert body_limit_bytes(8192, 82) == 8192 * (82 + MESSAGE_JSON_BYTES) + BASE_JSON_BYTES == 1_261_568
    assert body_limit_bytes(64, 82) == MIN_BODY_BYTES  # a tiny context still gets the floor
    assert body_limit_bytes(100_000, 10) > body_limit_bytes(50_000, 10)
    with pytest.raises(ValueError):
        body_limit_bytes(0, 10)


def test_the_largest_chat_the_context_can_take_fits_the_limit():
    """Worst case by the rule's own terms: max_model_len one-token messages of the longest
    token, pretty-printed by a client that escapes everything it can."""
    longest = "\n" + " " * 80  # 82 bytes as JSON
    n = 512
    body = json.dumps({"model": "m", "messages": [{"role": "assistant", "content": longest}] * n,
                       "stop": ["\u00e9" * 256] * 16, "max_tokens": 16}, indent=1, ensure_ascii=True).encode()
    assert len(body) <= body_limit_bytes(n, len(json.dumps(longest)) - 2)


def test_byte_budget_takes_refuses_and_gives_back():
    b = ByteBudget(100)
    assert b.try_take(60) and b.held == 60
    assert not b.try_take(41) and b.refused == 1 and b.held == 60  # a refusal takes nothing
    assert b.try_take(40) and b.held == 100 == b.peak
    b.give_back(60)
    assert b.held == 40 and b.try_take(0)
    with pytest.raises(ValueError):
        b.give_back(41)  # more than is held: a bookkeeping bug, not a silent negative
    with pytest.raises(ValueError):
        b.try_take(-1)
    with pytest.raises(ValueError):
        ByteBudget(0)


def test_admission_counts_entries_and_refuses_past_the_limit():
    a = Admission(2)
    assert a.try_enter() and a.try_enter()
    assert not a.try_enter() and a.refused == 1 and a.active == 2
    a.leave()
    assert a.try_enter() and a.peak == 2
    a.leave()
    a.leave()
    with pytest.raises(ValueError):
        a.leave()


def test_retry_hint_grows_with_the_backlog_and_falls_as_requests_leave():
    h = RetryHint(base_ms=200, max_ms=20_000, window_s=2.0)
    assert h.hint_ms(100.0) == 200  # nothing refused: the base
    h.refused(100.0)
    assert h.hint_ms(100.0) == 200  # one refused, nothing has left yet: a moment at the limit, the base
    for _ in range(4):
        h.refused(100.5)
    # 5 refused and none left in 2.5 s: the drain is slower than 1 per 2.5 s, so at least 12.5 s.
    assert h.hint_ms(100.5) == int(1000 * 2.5 * 5)
    h = RetryHint(base_ms=200, max_ms=20_000, window_s=2.0)
    for _ in range(10):
        h.finished(100.0)
    h.refused(100.0)
    assert h.hint_ms(100.0) == 200  # 1 refused against 10 that left in 2 s: 0.2 s, the base
    for _ in range(99):
        h.refused(101.0)
    # 100 refused, 10 left over 3 s (the last window and this one's first second): 30 s, capped.
    assert h.hint_ms(101.0) == 20_000
    for _ in range(290):
        h.finished(101.5)
    assert h.hint_ms(101.5) == int(1000 * 3.5 * 100 / 300)  # 100 waiting at 300 per 3.5 s
    # Two quiet windows later the old refusals are forgotten.
    assert h.hint_ms(106.0) == 200
    with pytest.raises(ValueError):
        RetryHint(base_ms=0)


def _cfg(**fields) -> RouterConfig:
    return RouterConfig(redis_url="redis://unused", model_name="m", tokenizer_dir="unused", max_model_len=8192,
                        **fields)


def test_front_limits_from_the_config_and_the_tokenizer():
    lim = front_limits(_cfg(), SimpleNamespace(max_token_json_bytes=82))
    assert lim.body_limit == 1_261_568 and "max_model_len 8192 tokens" in lim.body_limit_source
    assert lim.budget.capacity == 128 << 20 and lim.admission.limit == _cfg().rpc_limit
    assert front_limits(_cfg(max_body_bytes=5000), None).body_limit == 5000
    with pytest.raises(ValueError, match="max_buffered_bytes .* must hold one body"):
        front_limits(_cfg(max_buffered_bytes=1 << 20), SimpleNamespace(max_token_json_bytes=82))
    with pytest.raises(ValueError, match="must hold one body of max_body_bytes"):
        _cfg(max_body_bytes=2000, max_buffered_bytes=1000)
    with pytest.raises(ValueError, match="max_body_bytes must be set"):
        front_limits(_cfg(), None)


def test_smollm2_tokenizer_longest_token_as_json(tok_dir):
    from router.tokenizer import PromptTokenizer

    assert PromptTokenizer(tok_dir).max_token_json_bytes == 82


def test_a_429_from_further_in_counts_and_gets_the_longer_hint():
    """The front door around a plain ASGI app that answers 429 with the orchestrator's fixed
    200 ms hint: the refusal counts in the hint, the headers get the hint, the slot and the
    bytes come back."""
    import asyncio
    import time

    from frontend.http_front import FrontDoor

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"retry-after", b"1"), (b"retry-after-ms", b"200")]})
        await send({"type": "http.response.body", "body": b"{}"})

    limits = front_limits(_cfg(max_body_bytes=5000), None)
    limits.retry.finished(time.monotonic())
    for _ in range(50):  # a backlog the front door refused, against one request that left
        limits.retry.refused(time.monotonic())
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/v1/completions", "headers": [(b"content-length", b"2")]}
    asyncio.run(FrontDoor(app, limits)(scope, receive, send))
    headers = dict(sent[0]["headers"])
    hint = int(headers[b"retry-after-ms"])
    assert hint > 200 and headers[b"retry-after"] == str(-(-hint // 1000)).encode()
    assert limits.admission.active == 0 and limits.budget.held == 0
    assert limits.retry.hint_ms(time.monotonic()) >= hint  # 51 refused now, still one left
