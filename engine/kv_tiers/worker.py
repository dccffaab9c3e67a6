"""``TierWorker``: one thread running the tiers' jobs (copies out of the device pool, file writes
and deletions) in submission order, off the engine's step.

A job's result or exception lands in the done queue and ``on_done`` is called (from the worker
thread: it must only wake the engine loop). The engine thread takes results with
``take_done``: all bookkeeping stays on the engine thread. Torch-free.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class TierWorker:
    """One thread running submitted jobs in order; see the module docstring."""

    def __init__(self, name: str, on_done: Callable[[], None] | None = None) -> None:
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Any, Callable[[], Any]]] = deque()
        self._done: deque[tuple[Any, bool, Any, float]] = deque()
        self._running = 0
        self._stopping = False
        self.on_done = on_done
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Jobs queued or running, or results not yet taken."""
        with self._cond:
            return bool(self._jobs or self._running or self._done)

    def submit(self, token: Any, fn: Callable[[], Any]) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the tier worker is stopped")
            self._jobs.append((token, fn))
            self._cond.notify_all()

    def take_done(self) -> list[tuple[Any, bool, Any, float]]:
        """Finished jobs in order: (token, ok, result or exception, seconds)."""
        with self._cond:
            out = list(self._done)
            self._done.clear()
            return out

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every submitted job finished (results may wait in ``take_done``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued jobs, then stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                token, fn = self._jobs.popleft()
                self._running = 1
            t0 = time.perf_counter()
            try:
                result, ok = fn(), True
            except Exception as err:  # handed to the engine thread, which decides
                result, ok = err, False
            with self._cond:
                self._done.append((token, ok, result, time.perf_counter() - t0))
                self._running = 0
                self._cond.notify_all()
            if self.on_done is not None:
                try:
                    self.on_done()
                except Exception:
                    log.exception("tier worker's on_done callback failed")
