"""Admission: serve a request only when its predicted latency can meet its SLO class.

Pure: a placement's estimate and an SLO class in, a decision out. Rejecting early (with
RESOURCE_EXHAUSTED and a retry hint) is kinder than queueing a request that will miss its
deadline anyway: the client can retry elsewhere or later, and the queue it would have joined
stays short for requests that can still make it. No queue grows without bound: a request whose
predicted wait exceeds its class's TTFT budget is never queued.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SloClass:
    """Latency targets of a class of requests. The TTFT budget grows with the prompt (a 100k
    token prompt cannot start as fast as a 100 token one on any hardware)."""

    name: str
    ttft_s: float  # budget for an empty prompt
    ttft_per_1k_tokens_s: float  # added per 1000 prompt tokens
    tbt_s: float  # time between tokens, decode

    def ttft_budget_s(self, prompt_tokens: int) -> float:
        return self.ttft_s + self.ttft_per_1k_tokens_s * prompt_tokens / 1000


SLO_CLASSES: dict[str, SloClass] = {
    "interactive": SloClass("interactive", 0.5, 0.1, 0.05),
    "standard": SloClass("standard", 2.0, 0.25, 0.1),
    "relaxed": SloClass("relaxed", 60.0, 1.0, 1.0),
    "batch": SloClass("batch", math.inf, 0.0, math.inf),
}


@dataclass(frozen=True, slots=True)
class Estimate:
    """What placement predicts for the chosen (prefill, decode) pair, in seconds."""

    queue_s: float = 0.0  # wait on the prefill node before this request starts
    # compute of the uncached tokens, plus whatever loading the queue wait did not hide
    prefill_s: float = 0.0
    transfer_s: float = 0.0  # KV prefill -> decode
    decode_wait_s: float = 0.0  # wait for a decode slot
    tbt_s: float = 0.0  # predicted time between tokens on the decode node with this request
    # bringing the prompt's held blocks to the device (onboarding the node's host or disk
    # hits, fetching a peer's): it starts on arrival, so only what outlasts queue_s shows
    load_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s + self.transfer_s + self.decode_wait_s

    @property
    def compute_s(self) -> float:
        """The node's compute for this request: what it adds to the node's queue (the
        ledger), loading aside (bytes move while the node computes other requests)."""
        return max(0.0, self.prefill_s - max(0.0, self.load_s - self.queue_s))


@dataclass(frozen=True, slots=True)
class Decision:
    admit: bool
    reason: str = ""
    retry_after_ms: int | None = None


def decide(est: Estimate, slo: SloClass, prompt_tokens: int, min_retry_ms: int = 100,
           max_retry_ms: int = 30_000) -> Decision:
    """Admit iff the predicted TTFT and TBT meet ``slo``. A rejection's retry hint is the time
    the queue needs to drain enough for this request to fit: the excess over the budget, which
    is how far the queue must shrink (retrying sooner would be rejected again)."""
    budget = slo.ttft_budget_s(prompt_tokens)
    if est.tbt_s > slo.tbt_s:
        # A decode batch drains as its requests finish; a second is a typical request's tail.
        return Decision(False, f"predicted time between tokens {est.tbt_s * 1e3:.0f} ms exceeds the "
                               f"{slo.name} SLO of {slo.tbt_s * 1e3:.0f} ms", _clamp(1000, min_retry_ms, max_retry_ms))
    if est.ttft_s > budget:
        if est.prefill_s + est.transfer_s > budget:
            # Even an idle cluster misses: retrying changes nothing, but say so and how much.
            return Decision(False, f"predicted time to first token {est.ttft_s:.2f} s exceeds the {slo.name} "
                                   f"SLO of {budget:.2f} s even without queueing", None)
        excess_ms = (est.ttft_s - budget) * 1e3
        return Decision(False, f"predicted time to first token {est.ttft_s:.2f} s ({est.queue_s:.2f} s queued) "
                               f"exceeds the {slo.name} SLO of {budget:.2f} s",
                        _clamp(math.ceil(excess_ms), min_retry_ms, max_retry_ms))
    return Decision(True)


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))
