"""What one request's response stream tells the router's metrics: time to first token,
inter-token latency per sample, end-to-end latency, queue time, token counts and finish
reasons, all measured from the router's arrival time (what the client sees, give or take the
network).

Kept apart from the orchestrator so that the orchestrator only says "this response went out"
and "this request ended": the arithmetic lives here and is tested on plain messages.
"""
from __future__ import annotations

import time

from protos.pdserve.v1 import serving_pb2 as pb
from telemetry.metrics import RequestMetrics
from tokens.stop import FinishReason

_REASON_NAMES = {pb.FinishReason.Value(f"FINISH_REASON_{r.name}"): r.value for r in FinishReason}


class StreamObserver:
    """Feed every response of one request, then ``finish()`` once (also on failure)."""

    def __init__(self, metrics: RequestMetrics, arrival: float) -> None:
        self.m = metrics
        self.arrival = arrival
        self._first_token_seen = False
        self._last_chunk_at: dict[int, float] = {}
        self._prompt_counted = False
        self._finished = False

    def queued(self, queue_s: float) -> None:
        self.m.queue.observe(queue_s)

    def feed(self, resp: pb.GenerateResponse, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        kind = resp.WhichOneof("kind")
        if kind == "chunk":
            ch = resp.chunk
            if not ch.token_ids:
                return
            if not self._first_token_seen:
                self._first_token_seen = True
                self.m.ttft.observe(now - self.arrival)
            prev = self._last_chunk_at.get(ch.index)
            if prev is not None:
                # A chunk can carry several tokens (a speculative step): spread the gap over them.
                gap = (now - prev) / len(ch.token_ids)
                for _ in ch.token_ids:
                    self.m.itl.observe(gap)
            self._last_chunk_at[ch.index] = now
        elif kind == "complete":
            done = resp.complete
            if not self._prompt_counted:
                self._prompt_counted = True  # every sample's Complete repeats the prompt's count
                self.m.prompt_tokens.inc(done.usage.prompt_tokens)
            self.m.generation_tokens.inc(done.usage.completion_tokens)
            self.m.success(_REASON_NAMES.get(done.finish_reason, "unknown"))

    def finish(self, now: float | None = None) -> None:
        if self._finished:
            return
        self._finished = True
        now = time.monotonic() if now is None else now
        self.m.e2e.observe(now - self.arrival)
