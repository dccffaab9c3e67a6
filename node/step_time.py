"""A node's load as it heartbeats it (``LoadSnapshot``, written by the engine loop,
node/engine_thread.py) and the step times in it (``step_s``, ``decode_step_s``): an
exponential average with ``STEP_S_ALPHA`` on the newest step, so a slowdown shows within a
few steps, forgotten ``STEP_S_STALE_S`` after the last one (a node once slow must not stay
avoided forever for want of steps to measure). Plain data, time passed in.

The decode-only steps' average comes with the batch and context they ran, averaged alike
(``DecodeStepAverage``): the planner fits a step's cost as a line in those two, and a line's
value at the averages is the average of its values, so the three figures belong together; the
step time alone, paired with whatever batch ran when the heartbeat left, was not. (It was not
what kept a colocated node's fitted cost per sequence high, though: 11.6 ms against the decode
node's 5.4 paired with the heartbeat's batch, 10.4-11.3 against 5.9-7.3 paired with its own, in
the elastic benchmark's seed-4 runs of 2026-12-03; docs/benchmarks.md.)"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

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


class DecodeStepAverage:
    """The decode-only steps' time, batch (running sequences) and context (their tokens): one
    ``StepAverage`` each, folded at the same instants, so they go stale and restart together.
    The engine loop writes it, any thread reads it."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts = (StepAverage(), StepAverage(), StepAverage())  # seconds, batch, context tokens

    def add(self, seconds: float, batch: int, context_tokens: int, now: float) -> None:
        for part, x in zip(self._parts, (seconds, batch, context_tokens)):
            part.add(float(x), now)

    def value(self, now: float) -> tuple[float, float, float]:
        """(seconds, batch, context tokens), rounded as heartbeated; zeros once stale."""
        seconds, batch, context = (p.value(now) for p in self._parts)
        return seconds, batch, context


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The engine's load as of the last loop iteration; what nodes heartbeat to Redis."""

    waiting: int = 0
    running: int = 0
    running_tokens: int = 0  # tokens (prompt + output) of running sequences: their KV footprint
    free_blocks: int = 0
    num_blocks: int = 0
    kv_usage: float = 0.0
    # Seconds per engine step, averaged over recent steps: what a running sequence waits per
    # token. 0 = unknown (no step within STEP_S_STALE_S). Routers avoid a node whose steps are
    # several times slower than its peers' (router/placement.py, without_stragglers).
    step_s: float = 0.0
    # The same over the steps that ran no prompt tokens: a decode step alone. A node that
    # prefills prompts itself (colocated, or below the short-prompt threshold) has both kinds,
    # and its average carries the chunks; the planner counts those apart and fits the decode
    # step on this one (router/planner/signals.py DecodeFit). 0 = unknown.
    decode_step_s: float = 0.0
    # ... and the batch and context those steps ran (averaged alike, DecodeStepAverage): the
    # figures the step time belongs to, not the batch running when the heartbeat leaves. 0 = unknown.
    decode_step_running: float = 0.0
    decode_step_tokens: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


def fresh(load: LoadSnapshot, steps: StepAverage, decode_steps: DecodeStepAverage, now: float) -> LoadSnapshot:
    """``load`` with the step times that went stale since the loop wrote it dropped: an idle loop
    refreshes nothing, and a node once slow must not stay avoided forever for want of steps."""
    if load.step_s and not steps.value(now):
        load = replace(load, step_s=0.0)
    if load.decode_step_s and not decode_steps.value(now)[0]:
        load = replace(load, decode_step_s=0.0, decode_step_running=0.0, decode_step_tokens=0.0)
    return load
