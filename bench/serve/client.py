"""The load generator of `pdserve bench serve`: sends a workload to a running router on its
schedule and records what every request saw, through the SDK (gRPC) or the official ``openai``
client (HTTP).

It is one asyncio loop: sending a request is a task started at its arrival time, so a slow
request never delays the next one (open-loop arrivals, as the serving benchmarks of vLLM and
SGLang do). The generator reports its own lag (send time minus scheduled time): a lagging
generator would understate the load, and a reader can check it did not.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from bench.serve.metrics import Record
from bench.serve.workload import LoadRequest

# Seconds one request may take before the generator gives up on it (recorded as an error).
REQUEST_TIMEOUT_S = 600.0


async def send_grpc(client, req: LoadRequest, rec: Record, clock: Callable[[], float],
                    tokens: list[int] | None = None) -> None:
    """One request through the SDK, greedy; ``rec`` filled as it streams (times on ``clock``),
    its output token ids appended to ``tokens`` when given."""
    stream = client.generate(token_ids=list(req.prompt), max_tokens=req.max_tokens, temperature=0.0,
                             ignore_eos=True, timeout=REQUEST_TIMEOUT_S)
    last = None
    async for chunk in stream:
        now = clock()
        if not chunk.token_ids:
            continue
        rec.streamed_tokens += len(chunk.token_ids)
        if tokens is not None:
            tokens.extend(chunk.token_ids)
        if rec.first_token_s is None:
            rec.first_token_s = now
        elif last is not None:
            rec.itl.extend([(now - last) / len(chunk.token_ids)] * len(chunk.token_ids))
        last = now
    rec.end_s = clock()
    done = stream.completion
    if done is None or done.finish_reason == "error":
        rec.error = "stream ended without a completion" if done is None else "finished with error"
        return
    rec.output_tokens = done.usage.completion_tokens
    rec.cached_tokens = done.usage.cached_prompt_tokens
    rec.transfer_s = done.timings.transfer_s
    rec.spec_draft_tokens = done.usage.spec_draft_tokens
    rec.spec_accepted_tokens = done.usage.spec_accepted_tokens


async def _send_openai(client, model: str, req: LoadRequest, rec: Record, clock: Callable[[], float]) -> None:
    stream = await client.completions.create(
        model=model, prompt=list(req.prompt), max_tokens=req.max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, timeout=REQUEST_TIMEOUT_S)
    last = None
    async for chunk in stream:
        now = clock()
        if chunk.usage is not None:
            rec.output_tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            rec.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
        if not chunk.choices or not chunk.choices[0].text:
            continue
        # The completions stream does not say how many tokens a chunk holds: one per chunk
        # (exact without speculation; a speculative step's chunk then counts as one gap).
        if rec.first_token_s is None:
            rec.first_token_s = now
        elif last is not None:
            rec.itl.append(now - last)
        last = now
    rec.end_s = clock()


async def run_load(workload: Sequence[LoadRequest], *, target: str, api: str = "grpc", model: str = "",
                   concurrency: int | None = None,
                   progress: Callable[[str], None] | None = None) -> list[Record]:
    """Send every request at its arrival offset; returns one Record per request, in order.
    ``target``: the router's gRPC address (api "grpc") or its HTTP base URL (api "openai").
    ``concurrency``: instead of arrival times, keep this many requests in flight (closed loop:
    the next request goes out when one finishes)."""
    loop = asyncio.get_running_loop()
    clock = loop.time
    records = [Record(i, r.kind, len(r.prompt), r.max_tokens, r.arrival_s) for i, r in enumerate(workload)]
    if api == "grpc":
        import pdserve

        client = pdserve.AsyncClient(target, retries=0)
        send = lambda req, rec: send_grpc(client, req, rec, clock)  # noqa: E731
    elif api == "openai":
        import openai

        client = openai.AsyncOpenAI(base_url=f"{target.rstrip('/')}/v1", api_key="unused", max_retries=0)
        send = lambda req, rec: _send_openai(client, model, req, rec, clock)  # noqa: E731
    else:
        raise ValueError(f"api must be 'grpc' or 'openai', got {api!r}")

    done = 0
    last_report = time.monotonic()
    start = clock()

    slots = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(req: LoadRequest, rec: Record) -> None:
        if slots is None:
            delay = start + req.arrival_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            await measure(req, rec, req.arrival_s)
        else:
            async with slots:
                await measure(req, rec, clock() - start)  # closed loop: due as soon as a slot frees

    async def measure(req: LoadRequest, rec: Record, due_s: float) -> None:
        nonlocal done, last_report
        rec.sent_s = clock() - start
        rec.scheduled_s = due_s
        try:
            await send(req, rec)
        except Exception as e:  # a refused or failed request is a data point, not a crash
            rec.error = f"{type(e).__name__}: {str(e)[:200]}"
            rec.end_s = clock()
        # Record times relative to the run's start, like sent_s.
        if rec.first_token_s is not None:
            rec.first_token_s -= start
        if rec.end_s is not None:
            rec.end_s -= start
        done += 1
        if progress is not None and (time.monotonic() - last_report > 5.0 or done == len(records)):
            last_report = time.monotonic()
            progress(f"{done}/{len(records)} requests done ({sum(r.error is not None for r in records)} failed)")

    try:
        await asyncio.gather(*(one(req, rec) for req, rec in zip(workload, records)))
    finally:
        await client.close()
    return records
