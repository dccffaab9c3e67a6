"""Warnings that would come once per request under overload, logged at a bounded rate.

A refused reservation or prefill is routine when the cluster is full (the request still runs:
the decode node prefills it), and at a few hundred refusals a second one warning each buried
everything else in the log. Per reason (the call and its status code) the first occurrence is
logged in full; later ones within ``interval_s`` are only counted, and the next occurrence
after the interval logs itself plus "N more ... in the last T s". The count of a burst's tail
is therefore reported with the reason's next occurrence (its window says how long that was).

Shared by the router (refused reservations and prefills) and the prefill node (failed KV
transfers: a decode node that refuses or has gone fails every push to it). Only the log is
thinned: the Prometheus counters are incremented per event elsewhere and stay exact. Plain data with an injected clock, so the tests need no logger timing.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_INTERVAL_S = 10.0


@dataclass(slots=True)
class _Window:
    started: float  # when the occurrence that opened this window was logged
    suppressed: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    log: bool  # log this occurrence
    suppressed: int = 0  # occurrences of this reason not logged since the last logged one
    window_s: float = 0.0  # over how long they came


class RateLimiter:
    """Decides, per reason, which occurrences are logged: the first, then at most one per
    ``interval_s`` carrying the count of those skipped. Thread-safe (the router logs from its
    event loop and from worker threads, a node from its gRPC threads)."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def note(self, reason: str) -> Decision:
        now = self._clock()
        with self._lock:
            w = self._windows.get(reason)
            if w is None:
                self._windows[reason] = _Window(now)
                return Decision(True)
            if now - w.started < self.interval_s:
                w.suppressed += 1
                return Decision(False)
            d = Decision(True, w.suppressed, now - w.started)
            w.started, w.suppressed = now, 0
            return d


class RateLimitedLog:
    """``warning(reason, msg, *args)`` through a ``RateLimiter``: the reason's first occurrence
    and then one per interval, each followed by how many were skipped."""

    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.limiter = RateLimiter(interval_s, clock)

    def warning(self, reason: str, msg: str, *args: object) -> bool:
        """Log at WARNING unless ``reason`` was logged less than the interval ago. True if logged."""
        d = self.limiter.note(reason)
        if not d.log:
            self.logger.debug(msg, *args)  # every occurrence stays visible at DEBUG
            return False
        if d.suppressed:
            self.logger.warning(msg + " (and %d more %s in the last %.0f s, not logged)", *args, d.suppressed,
                                reason, d.window_s)
        else:
            self.logger.warning(msg, *args)
        return True
