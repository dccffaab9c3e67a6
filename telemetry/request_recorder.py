"""``RequestRecorder``: one request's latency and token figures recorded into ``RequestMetrics``
(telemetry/metrics.py), the one bookkeeping the router and the nodes share."""
from __future__ import annotations

import time
from collections.abc import Callable

from telemetry.metrics import RequestMetrics


class RequestRecorder:
    """One request's life on one process, recorded into ``RequestMetrics`` as it happens: the
    one bookkeeping of the router (router/request_metrics.py feeds it the client's stream) and
    of the nodes (their handlers feed it engine outputs), so their series count alike.

    The caller feeds plain facts (no engine or wire types here): when the request was first
    scheduled, each streamed output of each sample, the finish. What gets observed:

    - ``time_to_first_token_seconds``: ``arrival`` -> the first output that carries tokens;
    - ``inter_token_latency_seconds``: per sample, one observation per token (vLLM's
      convention): an output carrying n tokens after a gap g (from the sample's previous
      output with tokens) is n observations of g / n, so a speculative step of 3 tokens counts
      3 and a sample of N tokens streamed one at a time N - 1;
    - ``request_queue_time_seconds``: ``arrival`` -> the first scheduled step (once);
    - ``request_success_total{finished_reason}``: once per sample, when its reason is known;
    - at ``finish``: ``e2e_request_latency_seconds``, the prompt tokens and the tokens generated.

    Every duration is clamped at 0 (``arrival`` may come from another clock reading than
    ``now``). Times are ``clock()`` values (``time.monotonic`` by default, the engine's clock
    too). Each method is called by the one thread (or event loop) that serves the request.
    """

    def __init__(self, requests: RequestMetrics, arrival: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.requests = requests
        self.clock = clock
        self.arrival = clock() if arrival is None else arrival
        self.first_token_at: float | None = None
        self.generated = 0
        self._queued = False
        self._last: dict[int, float] = {}  # sample index -> time of its last output with tokens
        self._finished = False

    def scheduled(self, at: float | None) -> None:
        """The engine's first scheduled step for the request (None: not yet, ignored)."""
        if at is not None and not self._queued:
            self._queued = True
            self.requests.queue.observe(max(0.0, at - self.arrival))

    def sample(self, index: int, new_tokens: int, finish_reason: str | None = None,
               now: float | None = None) -> None:
        """One output of sample ``index``: ``new_tokens`` tokens, and its finish reason if it
        finished with this output."""
        now = self.clock() if now is None else now
        if new_tokens > 0:
            if self.first_token_at is None:
                self.first_token_at = now
                self.requests.ttft.observe(max(0.0, now - self.arrival))
            last = self._last.get(index)
            if last is not None:
                gap = max(0.0, now - last) / new_tokens
                for _ in range(new_tokens):
                    self.requests.itl.observe(gap)
            self._last[index] = now
            self.generated += new_tokens
        if finish_reason is not None:
            self.requests.success(finish_reason)

    def finish(self, prompt_tokens: int, now: float | None = None, generated: int | None = None) -> None:
        """The request ended (every sample finished); idempotent. ``generated``: the tokens to
        count, when the caller knows better than the outputs fed to ``sample`` (the router
        counts each sample's reported usage); None: those outputs' tokens."""
        if self._finished:
            return
        self._finished = True
        now = self.clock() if now is None else now
        self.requests.e2e.observe(max(0.0, now - self.arrival))
        self.requests.prompt_tokens.inc(prompt_tokens)
        self.requests.generation_tokens.inc(self.generated if generated is None else generated)


