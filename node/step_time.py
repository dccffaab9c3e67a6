"""A node's step time as it heartbeats it (``LoadSnapshot.step_s``, ``decode_step_s``): an
exponential average with ``STEP_S_ALPHA`` on the newest step, so a slowdown shows within a
few steps, forgotten ``STEP_S_STALE_S`` after the last one (a node once slow must not stay
avoided forever for want of steps to measure). Plain data, time passed in."""
from __future__ import annotations

STEP_S_ALPHA = 0.3
STEP_S_STALE_S = 30.0


class StepAverage:
    """One running average of step times; the engine loop writes it, any thread reads it."""

    __slots__ = ("_avg", "_at")

    def __init__(self) -> None:
        self._avg = 0.0
        self._at = 0.0  # monotonic clock of the last step folded in

    def add(self, seconds: float, now: float) -> None:
        prev = self.value(now)
        self._avg = seconds if prev <= 0 else prev + STEP_S_ALPHA * (seconds - prev)
        self._at = now

    def value(self, now: float) -> float:
        """The average, rounded as heartbeated; 0 once stale (or before any step)."""
        return round(self._avg, 6) if now - self._at <= STEP_S_STALE_S else 0.0
