"""Reusable receive buffers.

A fresh multi-MiB bytearray costs a page fault per 4 KiB on first touch, comparable to the copy
itself (``pdserve bench transfer`` reports fresh vs reused in its ``components``); reusing warm
buffers avoids that.
"""
from __future__ import annotations

import threading


class BufferPool:
    """Hands out bytearrays of at least the asked size; keeps up to ``max_cached_bytes`` of
    released ones for reuse. Thread-safe; a buffer must not be used after release()."""

    def __init__(self, max_cached_bytes: int = 256 << 20) -> None:
        self._max_cached_bytes = max_cached_bytes
        self._lock = threading.Lock()  # guards _free and _cached_bytes
        self._free: list[bytearray] = []
        self._cached_bytes = 0

    def acquire(self, nbytes: int) -> bytearray:
        with self._lock:
            # Smallest cached buffer that fits, so big ones stay for big transfers
            # (_free is sorted by size; bytearrays compare by content, so pick by index.)
            for i, buf in enumerate(self._free):
                if len(buf) >= nbytes:
                    del self._free[i]
                    self._cached_bytes -= len(buf)
                    return buf
        return bytearray(nbytes)

    def release(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)
            self._cached_bytes += len(buf)
            # Over budget: drop the smallest first (the large ones are the costly ones to fault in).
            self._free.sort(key=len)
            while self._cached_bytes > self._max_cached_bytes and self._free:
                self._cached_bytes -= len(self._free.pop(0))
