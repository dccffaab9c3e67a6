"""A one-line progress indicator on stderr: a spinner on a terminal, one timestamped line per
stage in a log (`pdserve generate` while the model loads)."""
from __future__ import annotations

import sys
import threading
import time


class Spinner:
    """A one-line progress indicator on stderr for long, silent operations (model load)."""

    FRAMES = "|/-\\"

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.msg = "starting"
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._tty = stream.isatty()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Spinner":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._tty:
            self.stream.write("\r\033[K")
        self.stream.flush()

    def update(self, msg: str) -> None:
        self.msg = msg
        if not self._tty:  # a log, not a terminal: one line per stage
            self.stream.write(f"[{time.perf_counter() - self._t0:6.1f}s] {msg}\n")
            self.stream.flush()

    def _run(self) -> None:
        i = 0
        while not self._stop.wait(0.1):
            if self._tty:
                frame = self.FRAMES[i % len(self.FRAMES)]
                self.stream.write(f"\r\033[K{frame} {self.msg} ({time.perf_counter() - self._t0:.1f}s)")
                self.stream.flush()
            i += 1
