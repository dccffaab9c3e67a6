"""A node's health as plain logic: when failing engine steps make it unhealthy, and when a node
that keeps failing stops being restarted. No I/O: the engine thread counts steps with
``StepHealth``; the node actor (node/actor.py) runs ``StartPolicy`` over the record it keeps in
Redis (kv_index/health.py).

Failing steps. One failed step fails the requests it held (they migrate: a request that caused
it must not take the next node down too, so the router retries it once). A step that fails
``limit`` times in a row says the node itself is broken (a wedged accelerator, a corrupt
engine state): the node turns unhealthy, leaves the index and stops its engine. One good step
in between resets the count.

Crash loops. Ray restarts a node actor whose process died, immediately and as often as
``max_restarts`` allows (measured on Ray 2.60: about 0.7 s apart, forever with -1), and never
one whose constructor raised. So the actor bounds its own restarts: a *failed life* is a start
that raised or died, or a life that turned unhealthy without one good step since its last
failure. Before each start it waits ``delay_s(failures)`` (doubling up to a cap); after
``max_failures`` failed lives in a row it stays down, its reason recorded::

    life 1: start fails      failures 1  -> process exits, Ray restarts it
    life 2: waits 1 s, fails failures 2  -> exits, Ray restarts it
    life 3: waits 2 s, fails failures 3  -> down: the constructor raises, Ray stops
"""
from __future__ import annotations

from dataclasses import dataclass


class StepHealth:
    """Consecutive failing engine steps; unhealthy at ``limit`` in a row (0: never)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"max_step_failures must be >= 0 (0: never unhealthy), got {limit}")
        self.limit = limit
        self.consecutive = 0
        self.failed_steps = 0  # since start
        self.good_steps = 0

    def succeeded(self) -> None:
        self.consecutive = 0
        self.good_steps += 1

    def failed(self, err: BaseException) -> str | None:
        """Count a failed step; returns why the node is now unhealthy, or None."""
        self.consecutive += 1
        self.failed_steps += 1
        if self.limit and self.consecutive >= self.limit:
            return f"engine step failed {self.consecutive} times in a row; last: {err!r}"
        return None


@dataclass(frozen=True, slots=True)
class StartPolicy:
    """Crash-loop back-off of one node (see the module docstring)."""

    max_failures: int = 3  # failed lives in a row before the node stays down
    backoff_s: float = 1.0  # wait before the second try; doubles per failure
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_failures < 1:
            raise ValueError(f"max_start_failures must be >= 1, got {self.max_failures}")
        if not 0 <= self.backoff_s <= self.backoff_max_s:
            raise ValueError(f"need 0 <= backoff_s <= backoff_max_s, got {self.backoff_s}, {self.backoff_max_s}")

    def gives_up(self, failures: int) -> bool:
        """Whether a node with ``failures`` failed lives in a row stays down."""
        return failures >= self.max_failures

    def delay_s(self, failures: int) -> float:
        """How long to wait before the next start after ``failures`` failed lives in a row."""
        if failures <= 0:
            return 0.0
        return min(self.backoff_max_s, self.backoff_s * 2 ** (failures - 1))
