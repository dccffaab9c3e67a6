"""The router's request metrics: the response stream it relays, fed into the same
``RequestRecorder`` (telemetry/request_recorder.py) the nodes use, so router and node series follow one
convention (one inter-token-latency observation per token, durations clamped at 0). Times are
from the router's arrival: what the client sees, give or take the network.

What only the router does, and so lives here: it reads wire messages, and it counts tokens as
the client is billed them, each sample's Complete ``usage`` (the prompt once per request), not
as the chunks went by.
"""
from __future__ import annotations

import time

from protos.pdserve.v1 import serving_pb2 as pb
from router.placement import Placement
from router.planner.signals import RequestSample
from router.request_state import Prepared
from telemetry.metrics import RequestMetrics
from telemetry.request_recorder import RequestRecorder
from tokens.stop import FinishReason

_REASON_NAMES = {pb.FinishReason.Value(f"FINISH_REASON_{r.name}"): r.value for r in FinishReason}


class StreamObserver:
    """Feed every response of one request, then ``finish()`` once (also on failure)."""

    def __init__(self, metrics: RequestMetrics, arrival: float) -> None:
        self.recorder = RequestRecorder(metrics, arrival)
        self.prompt_tokens = 0  # from the first Complete: every sample's repeats the prompt's count
        self.generation_tokens = 0
        self._completed = False

    def queued(self, queue_s: float) -> None:
        """The router's queue (arrival -> the first attempt started) lasted ``queue_s``."""
        self.recorder.scheduled(self.recorder.arrival + queue_s)

    def feed(self, resp: pb.GenerateResponse, now: float | None = None) -> None:
        kind = resp.WhichOneof("kind")
        if kind == "chunk":
            self.recorder.sample(resp.chunk.index, len(resp.chunk.token_ids), now=now)
        elif kind == "complete":
            done = resp.complete
            if not self._completed:
                self._completed = True
                self.prompt_tokens = done.usage.prompt_tokens
            self.generation_tokens += done.usage.completion_tokens
            self.recorder.sample(done.index, 0, _REASON_NAMES.get(done.finish_reason, "unknown"), now)

    @property
    def ttft_s(self) -> float | None:
        """Arrival to the first token (None: none yet)."""
        first = self.recorder.first_token_at
        return None if first is None else max(0.0, first - self.recorder.arrival)

    def finish(self, now: float | None = None) -> None:
        self.recorder.finish(self.prompt_tokens, now, generated=self.generation_tokens)

    def planner_sample(self, placement: Placement, slo_class: str) -> RequestSample:
        """The finished request as the planner's window holds it (router/planner/signals.py)."""
        rec, now = self.recorder, self.recorder.clock()
        first = rec.first_token_at
        out = self.generation_tokens or rec.generated
        return RequestSample(time.time(), self.prompt_tokens, placement.predicted_cached_tokens, out,
                             None if first is None else max(0.0, first - rec.arrival),
                             None if first is None or out < 2 else max(0.0, now - first) / (out - 1),
                             slo_class, placement.prefill_node is None)


def in_flight_sample(prep: Prepared) -> RequestSample:
    """A placed request as the planner's window holds it until it finishes: its ``max_tokens``
    as the output it may still produce, no latencies yet: its TTFT once its first token comes
    (RequestWindow.first_token; router/planner/signals.py)."""
    return RequestSample(time.time(), prep.num_prompt_tokens, prep.placement.predicted_cached_tokens,
                         prep.params.max_tokens, None, None, prep.slo_class, prep.placement.prefill_node is None,
                         done=False, first_token_watched=True)
