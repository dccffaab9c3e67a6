"""The router's grammar compiles are bounded in number at once and its compile cache in bytes
(issue 49: the compile limit counted only compiles already past 2 s, so many slow ones started
at once and held every worker thread the router prepares requests on).

The main test sends 50 requests with 50 different slow constraints at once (real llguidance
compiles of 55 KB schemas, ~0.5 s each) through the router's real validator, on more threads
than the router would give them: at most ``max_concurrent_compiles`` compile at once, the rest
are refused RESOURCE_EXHAUSTED (HTTP 429) with a retry hint after the bounded wait, and the
event loop keeps answering meanwhile. The others are plain logic of ``GrammarCache``."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos.pdserve.v1 import serving_pb2 as pb
from router.config import RouterConfig
from router.validation import RequestValidator, RouterError
from tokens.grammar import GrammarBusy, GrammarCache, GrammarError


def slow_schema(seed: int, properties: int = 850) -> str:
    """A schema llguidance is slow on (~0.5 s): many optional integers, each in its own range,
    within the 64 KiB a spec may have."""
    return json.dumps({"type": "object", "properties": {
        f"f{i}": {"type": "integer", "minimum": i * 7 + seed, "maximum": i * 7919 + 123456} for i in range(properties)}})


def constrained(spec: str) -> pb.GenerateRequest:
    so = pb.StructuredOutput(kind=pb.STRUCTURED_KIND_JSON_SCHEMA, spec=spec)
    return pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=4, structured=so))


def test_fifty_slow_grammars_at_once_are_bounded_and_the_loop_still_answers(tok_dir):
    from router.tokenizer import PromptTokenizer

    cfg = RouterConfig(redis_url="redis://unused", model_name="m", tokenizer_dir=tok_dir, max_model_len=2048,
                       max_concurrent_compiles=2, compile_wait_s=0.05)
    validator = RequestValidator(cfg, PromptTokenizer(tok_dir))
    cache = validator.structured.cache
    validator.validate(constrained('{"type": "object"}'))  # llguidance's tokenizer, built once
    requests = [constrained(slow_schema(i)) for i in range(50)]

    def timed(req):
        t0 = time.perf_counter()
        try:
            validator.validate(req)
            return "ok", time.perf_counter() - t0
        except RouterError as e:
            return e, time.perf_counter() - t0

    async def go():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=64))  # every request on a thread of its own
        gaps, stop = [], asyncio.Event()

        async def heartbeat():
            last = loop.time()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = loop.time()
                gaps.append(now - last)
                last = now

        beat = asyncio.ensure_future(heartbeat())
        results = await asyncio.gather(*(asyncio.to_thread(timed, r) for r in requests))
        stop.set()
        await beat
        return results, max(gaps)

    results, worst_gap = asyncio.run(go())
    served = [t for r, t in results if r == "ok"]
    refused = [(r, t) for r, t in results if r != "ok"]
    assert cache.peak_running <= 2, cache.peak_running
    assert len(served) >= 2 and len(refused) >= 30, (len(served), len(refused))
    for e, took in refused:
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.param == "structured"
        assert e.retry_after_ms >= 200 and "max_concurrent_compiles" in e.message and "compile_wait_s" in e.message
        assert took < 1.5, took  # the bounded wait (0.05 s), not a compile: its thread came back at once
    assert worst_gap < 0.5, worst_gap  # the event loop kept answering
    # A refused constraint was not judged: sent again once the compiles are done, it passes.
    i = next(i for i, (r, _) in enumerate(results) if r != "ok")
    validator.validate(requests[i])


def test_a_compile_past_the_bound_keeps_its_slot_until_it_really_ends():
    """The slot is held by the native compile, not by its caller: a compile abandoned at the
    time bound still holds it, so the next constraint is busy (429), not a new thread."""
    cache = GrammarCache(timeout_s=0.01, max_concurrent=1, wait_s=0.01)
    release = threading.Event()
    try:
        with pytest.raises(GrammarError, match="compile-time bound"):
            cache.get("slow", lambda: release.wait(10))
        with pytest.raises(GrammarBusy, match="max_concurrent_compiles") as busy:
            cache.get("next", lambda: "never runs")
        assert busy.value.retry_after_ms >= 200
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while cache.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cache.get("next", lambda: "ok") == "ok" and cache.peak_running == 1
    assert cache.get("next", lambda: "not compiled again") == "ok"  # hits take no slot


def test_the_cache_is_bounded_by_the_bytes_of_its_specs():
    """Keys hold whole specs (a body may carry a MiB of schema): the cache keeps at most
    max_bytes of them, positive and negative entries alike, least recent out first."""
    cache = GrammarCache(size=1000, negative_size=1000, max_bytes=250_000)
    specs = [("json_schema", str(i) * 100_000, True) for i in range(5)]
    for spec in specs[:3]:
        cache.get(spec, lambda: "compiled")
    assert len(cache) == 2 and cache.bytes <= 250_000  # the oldest went
    assert cache.get(specs[2], lambda: "again") == "compiled"  # the newest stayed
    with pytest.raises(GrammarError, match="refused"):
        cache.get(specs[3], lambda: (_ for _ in ()).throw(ValueError("refused")))
    with pytest.raises(GrammarError, match="refused"):
        cache.get(specs[4], lambda: (_ for _ in ()).throw(ValueError("refused")))
    assert cache.bytes <= 250_000


def test_a_nodes_cache_is_bounded_by_its_matchers_native_bytes(tok_dir):
    """A node's cache holds compiled matchers, whose memory is llguidance's (~20 MB for the slow
    schema, a few KB for a small one): measured at compile, counted against max_bytes, so a
    30 MB cache does not keep three slow ones (least recent out, the small ones first)."""
    import llguidance

    from engine.structured.compiler import GrammarCompiler, allocated_bytes
    from router.tokenizer import PromptTokenizer
    from tokens.sampling_params import StructuredOutput

    if allocated_bytes() is None:
        pytest.skip("no mallinfo2 (not glibc): matchers are counted by their grammar's length")
    tok = PromptTokenizer(tok_dir)
    lt = llguidance.LLTokenizer(tok.to_json(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids) or None)
    compiler = GrammarCompiler(lt, GrammarCache(max_bytes=30 << 20))
    cache = compiler.cache
    small = [StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {f"a{i}": {"type": "string"}}}))
             for i in range(3)]
    slow = [StructuredOutput("json_schema", slow_schema(i)) for i in range(3)]
    for so in small:
        compiler.matcher(so)
    held_small = cache.bytes
    compiler.matcher(slow[0])
    assert cache.bytes - held_small > 5 << 20, cache.bytes  # the slow matcher's native memory counted
    for so in slow[1:]:
        compiler.matcher(so)
    assert cache.bytes <= 30 << 20 and len(cache) <= 2  # the small and the older slow matchers went
    assert compiler.compile(slow[2]) is compiler.compile(slow[2])  # the newest stayed, cached
