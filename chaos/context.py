"""What a scenario body gets and gives back: the run's options, the cluster and its requests
(``Run``), and what happened (``Outcome``). Shared by the scenario modules and the registry."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from chaos.history import RequestLog
from chaos.workload import Batch, Endpoints, RequestSpec, RetryBudget


@dataclass(frozen=True, slots=True)
class Options:
    """Per-run knobs (the CLI's flags of the same names)."""

    requests: int = 8  # concurrent streams, half greedy, half seeded sampled
    max_tokens: int = 48  # tokens per stream (EOS ignored)
    step_delay_s: float = 0.0  # every engine step slower by this, both runs (a tiny test model)
    restart_timeout_s: float = 120.0  # wait for Ray's restart of a killed node (0: do not)
    freeze_s: float = 8.0  # a frozen process (node, Redis) is continued after this
    partition_s: float = 8.0  # the proxy forwards again after this
    router_down_s: float = 2.0  # restart-router: the router is started again after this
    detect_bound_s: float = 5.0  # a frozen node or a cut-off link is detected within this
    unavailable_within_s: float = 15.0  # all-decode-down: a failed attempt failed within this
    budget: RetryBudget = RetryBudget()

    def __post_init__(self) -> None:
        if self.requests < 2 or self.max_tokens < 4:
            raise ValueError("chaos needs at least 2 requests of at least 4 tokens")
        for name in ("freeze_s", "partition_s", "router_down_s", "detect_bound_s", "unavailable_within_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


@dataclass(slots=True)
class Run:
    cluster: object  # chaos.cluster.ChaosCluster
    opts: Options
    specs: list[RequestSpec]
    progress: Callable[[str], None] = lambda m: None

    def endpoints(self) -> Endpoints:
        return Endpoints(self.cluster.address, self.cluster.http_address)

    def batch(self, specs: Sequence[RequestSpec] | None = None) -> Batch:
        return Batch(self.endpoints(), self.specs if specs is None else specs, self.opts.budget)

    def halves(self) -> tuple[list[RequestSpec], list[RequestSpec]]:
        """Two halves with greedy and sampled, gRPC and HTTP requests in each (make_specs's
        order: greedy, sampled, ...; the HTTP pairs every ``http_every`` pairs)."""
        first = [s for i, s in enumerate(self.specs) if i % 4 in (0, 3)]
        return first, [s for s in self.specs if s not in first]


@dataclass(slots=True)
class Outcome:
    logs: list[RequestLog]
    fault_at: float
    extra: dict = field(default_factory=dict)
    # Seconds from the fault until the system acted on it, where the body measures that itself
    # (``own_detect``); else the first migration the router made after the fault.
    detect_s: float | None = None
    own_detect: bool = False


def hold(batch: Batch, seconds: float, since: float) -> None:
    """Until ``seconds`` after ``since``, or until the batch is done, whichever comes first."""
    while time.monotonic() < since + seconds and not batch.done():
        time.sleep(0.05)
