"""What one policy's replay measured (``PolicyResult``) and its summary: the figures
``pdserve bench router`` prints and writes as JSON."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.quantiles import upper_rank

TIER_KEYS = ("device", "host", "disk", "remote")  # where a reused token came from


@dataclass(slots=True)
class PolicyResult:
    name: str
    ttft_s: list[float] = field(default_factory=list)  # per request, trace order; nan = rejected
    span_s: float = 0.0  # simulated seconds from the first arrival to the last
    input_tokens: int = 0
    cached_tokens: int = 0  # reused from any tier or fetched
    hit_tokens: Counter = field(default_factory=Counter)  # TIER_KEYS -> reused tokens ("remote": fetched)
    rejected: int = 0
    slo_met: int = 0  # TTFT within the class budget and TBT within its limit
    ttft_met: int = 0  # TTFT within the class budget (goodput)
    requests: int = 0
    router_round_trips: int = 0
    node_round_trips: int = 0
    busy_s: dict[str, float] = field(default_factory=dict)  # prefill node -> seconds computing
    node_requests: Counter = field(default_factory=Counter)  # prefill node -> requests served
    node_wait_s: Counter = field(default_factory=Counter)  # prefill node -> summed queue waits
    predicted_exact: int = 0  # requests whose predicted cached tokens == actually reused
    predicted_abs_err: int = 0
    fetched_tokens: int = 0
    freshness_s: list[float] = field(default_factory=list)  # age of the index at each lookup

    def summary(self, common: Sequence[bool] | None = None) -> dict:
        """``common[i]``: request i counts in the TTFT statistics (the requests every compared
        policy served); None: every request this policy served."""
        served = [x for x in self.ttft_s if not math.isnan(x)]
        t = sorted(served if common is None else [x for x, c in zip(self.ttft_s, common) if c])
        s = sorted(served)
        n_served = max(1, len(served))
        busy = list(self.busy_s.values()) or [0.0]
        mean_busy = sum(busy) / len(busy)
        nodes = sorted(self.busy_s)
        return {
            "hit_ratio": self.cached_tokens / max(1, self.input_tokens),
            "hit_tokens": {k: self.hit_tokens.get(k, 0) for k in TIER_KEYS},
            "goodput_rps": self.ttft_met / self.span_s if self.span_s > 0 else math.nan,
            "ttft_mean_s": sum(t) / len(t) if t else math.nan,
            "ttft_p50_s": upper_rank(t, 0.50, math.nan),
            "ttft_p99_s": upper_rank(t, 0.99, math.nan),
            "ttft_requests": len(t),
            "ttft_mean_served_s": sum(s) / len(s) if s else math.nan,
            "ttft_p99_served_s": upper_rank(s, 0.99, math.nan),
            "slo_attainment": self.slo_met / max(1, self.requests),
            "ttft_slo_attainment": self.ttft_met / max(1, self.requests),
            "imbalance": max(busy) / mean_busy if mean_busy > 0 else 1.0,
            "per_node": {n: {"busy_s": self.busy_s[n], "requests": self.node_requests.get(n, 0),
                             "mean_wait_s": self.node_wait_s.get(n, 0.0) / max(1, self.node_requests.get(n, 0))}
                         for n in nodes},
            "rejected": self.rejected,
            "redis_rtt_per_request": self.router_round_trips / max(1, self.requests),
            "node_rtt_per_request": self.node_round_trips / max(1, self.requests),
            "index_exact_fraction": self.predicted_exact / n_served,
            "index_mean_abs_err_tokens": self.predicted_abs_err / n_served,
            "index_age_mean_s": sum(self.freshness_s) / len(self.freshness_s) if self.freshness_s else 0.0,
            "fetched_tokens": self.fetched_tokens,
        }
