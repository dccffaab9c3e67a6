"""One request's outputs as its reader sees them (``OutputStream``), and the two ways a request
ends without finishing: its engine step failed, or the engine stopped. The engine loop
(node/engine_thread.py) writes each stream; a server's handler thread reads it.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from engine.outputs import RequestOutput


class EngineStoppedError(RuntimeError):
    """The engine loop is not running (shut down or never started)."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (the step raised); the request is gone."""


_DONE = object()  # end-of-stream marker in an OutputStream's queue


class OutputStream:
    """The outputs of one request, in order, for one reader thread.

    Iterate it (blocks until the request finishes), or call ``get(timeout)``. ``cancel()``
    aborts the request in the engine (a gRPC server calls it when the client goes away); the
    stream then ends with the engine's abort output.
    """

    def __init__(self, request_id: str, cancel: Callable[[str], Any]) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ended = threading.Event()  # set by the loop when it delivered the last item
        self._drained = False  # the reader has seen the end

    # ---- loop side
    def put(self, item: RequestOutput | BaseException) -> None:
        """Loop thread only (one writer): queue an output, or the error that failed the request.
        A finished output or an error ends the stream: ``finished`` turns True at once, and
        the reader gets what was queued before it, then the end."""
        self._queue.put(item)
        if isinstance(item, BaseException) or item.finished:
            self._ended.set()
            self._queue.put(_DONE)

    # ---- reader side
    @property
    def finished(self) -> bool:
        return self._ended.is_set()

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """Next output; None once the stream has ended. Raises TimeoutError, or the error that
        failed the request (RequestFailedError, EngineStoppedError)."""
        if self._drained:
            return None
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output for request {self.request_id!r} within {timeout}s") from None
        if item is _DONE:
            self._drained = True
            return None
        if isinstance(item, BaseException):
            self._drained = True
            raise item
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        return self.iter()

    def iter(self, timeout: float | None = None) -> Iterator[RequestOutput]:
        """Outputs until the request finishes; ``timeout`` bounds the wait for each one."""
        while (out := self.get(timeout)) is not None:
            yield out

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final output, with every sample's full token ids (waits for the finish)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last: RequestOutput | None = None
        latest = {}
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            out = self.get(left)
            if out is None:
                break
            for c in out.outputs:
                latest[c.index] = c
            last = out
        if last is None:
            raise RequestFailedError(f"request {self.request_id!r} ended without output")
        last.outputs = [latest[i] for i in sorted(latest)]
        return last

    def cancel(self) -> None:
        """Abort the request unless it already finished; idempotent, never raises."""
        if self._ended.is_set():
            return
        try:
            self._cancel(self.request_id)
        except EngineStoppedError:
            pass  # shutdown fails every stream on its own
