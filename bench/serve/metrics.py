"""Per-request records of `pdserve bench serve` -> the figures people compare, as plain data.

Definitions (DistServe's, which vLLM's and SGLang's serving benchmarks also use):

- TTFT: from the request's send time to its first token, measured by the client.
- TPOT: (end - first token) / (output tokens - 1): the mean time per output token after the
  first, one value per request (undefined for one-token answers, which then meet any TPOT SLO).
- ITL: every gap between two consecutive streamed chunks, divided by the tokens in the later
  chunk (a speculative step delivers several).
- goodput: requests that finished and met both the TTFT and the TPOT SLO, per second of the
  run (first send to last finish). A failed or refused request counts as a miss.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from router.quantiles import percentile


@dataclass(slots=True)
class Record:
    """One request as the client saw it (times in seconds on the client's monotonic clock)."""

    index: int
    kind: str
    prompt_tokens: int
    max_tokens: int
    scheduled_s: float  # when it should have been sent (offset from the run's start)
    sent_s: float = 0.0  # when it was sent (the same offset; the gap is the generator's lag)
    first_token_s: float | None = None
    end_s: float | None = None
    output_tokens: int = 0
    streamed_tokens: int = 0  # token ids the stream delivered (gRPC; must equal output_tokens)
    cached_tokens: int = 0
    transfer_s: float = 0.0  # KV transfer prefill -> decode, as the router reports it
    spec_draft_tokens: int = 0  # speculative decoding on the decode node (gRPC API only)
    spec_accepted_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None and self.first_token_s is not None

    @property
    def ttft(self) -> float | None:
        return self.first_token_s - self.sent_s if self.first_token_s is not None else None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return self.end_s - self.sent_s if self.end_s is not None else None

    def as_json(self) -> dict:
        d = asdict(self)
        d.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e)
        return d


@dataclass(frozen=True, slots=True)
class Slo:
    """TTFT and TPOT bounds. ``ttft_by_kind`` gives a request class its own TTFT bound (a
    1000-token document cannot have a chat turn's first-token time); others use ``ttft_s``."""

    ttft_s: float
    tpot_s: float
    ttft_by_kind: tuple[tuple[str, float], ...] = ()

    def ttft_for(self, kind: str) -> float:
        return dict(self.ttft_by_kind).get(kind, self.ttft_s)

    def met(self, r: Record) -> bool:
        if not r.ok or r.ttft > self.ttft_for(r.kind):
            return False
        tpot = r.tpot
        return tpot is None or tpot <= self.tpot_s

    def as_json(self) -> dict:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "ttft_s_by_kind": dict(self.ttft_by_kind)}


def _dist(values: Sequence[float]) -> dict:
    return {"mean": sum(values) / len(values) if values else None,
            "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99)}


def summarize(records: Sequence[Record], slo: Slo | None = None) -> dict:
    """The run's figures. ``duration_s`` runs from the first send to the last finish."""
    ok = [r for r in records if r.ok]
    starts = [r.sent_s for r in records]
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = (max(ends) - min(starts)) if ends and starts else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    ttfts = [r.ttft for r in ok]
    transfer_share = [r.transfer_s / r.ttft for r in ok if r.ttft and r.ttft > 0]
    out = {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "ttft_s": _dist(ttfts), "tpot_s": _dist([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": _dist([x for r in ok for x in r.itl]), "e2e_s": _dist([r.e2e for r in ok]),
        "cached_token_fraction": sum(r.cached_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0,
        "transfer_share_of_ttft": sum(transfer_share) / len(transfer_share) if transfer_share else 0.0,
        "spec_acceptance": (sum(r.spec_accepted_tokens for r in ok) / drafted
                            if (drafted := sum(r.spec_draft_tokens for r in ok)) else None),
        # The load generator's own lag: how late requests were sent against their schedule.
        "generator_lag_s": _dist([max(0.0, r.sent_s - r.scheduled_s) for r in records]),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
    if slo is not None:
        good = sum(1 for r in records if slo.met(r))
        out["slo_attainment"] = good / len(records) if records else 0.0
        out["goodput_rps"] = good / duration if duration else 0.0
    return out


def slo_from_unloaded(unloaded: Iterable[Sequence[Record]], ttft_factor: float, tpot_factor: float) -> Slo:
    """The SLO for every layout of a comparison, from each layout's unloaded requests (sent one
    at a time): per request kind, ``ttft_factor`` x the best layout's median unloaded TTFT of
    that kind; ``tpot_factor`` x the best layout's median unloaded TPOT. One SLO for all, so
    each layout is held to the latency a user was promised; the best unloaded figure, so the
    faster layout's speed is not given away to the slower one."""
    per_layout = [list(u) for u in unloaded]
    kinds = sorted({r.kind for u in per_layout for r in u if r.ok})
    by_kind = []
    for kind in kinds:
        medians = [percentile([r.ttft for r in u if r.ok and r.kind == kind], 50) for u in per_layout]
        by_kind.append((kind, min(m for m in medians if m is not None) * ttft_factor))
    ttft = min(percentile([r.ttft for r in u if r.ok], 50) for u in per_layout)
    tpot = min(percentile([t for r in u if (t := r.tpot) is not None], 50) for u in per_layout)
    return Slo(ttft * ttft_factor, tpot * tpot_factor, tuple(by_kind))


def knee(points: Sequence[Mapping]) -> Mapping | None:
    """The sweep point with the highest goodput (ties: the lower rate)."""
    best = None
    for p in sorted(points, key=lambda p: p["rate"]):
        if best is None or p["goodput_rps"] > best["goodput_rps"]:
            best = p
    return best
