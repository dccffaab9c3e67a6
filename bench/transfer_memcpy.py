"""The shared-memory transport's ceiling in `pdserve bench transfer`: a plain copy of the same
bytes, at its best on this machine. Timed three ways, interleaved with the transports:

  one_thread:   np.copyto into a reused buffer in the bench's process (the only way before
                2026-12: about 12.8 GB/s on the 2-core VM, which copies 18-20 GB/s with both
                cores, so shm's ratio was taken against less than the machine can do).
  threads:      the same copy cut into ``threads`` pieces (os.cpu_count()) that a thread pool
                copies at once; numpy releases the GIL in copyto, so the pieces run in parallel.
  two_process:  a shared-memory buffer copied into another by two processes, half each: the
                bench's process and a helper (``python -m bench.transfer_memcpy``), the way the
                shm transport's sender and receiver each copy on their own core.

The ceiling per size is the fastest of the three (``memcpy_gbps``), as the socket ceiling is
the fastest of its three modes.
"""
from __future__ import annotations

import mmap
import os
import secrets
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

WAYS = ("one_thread", "threads", "two_process")
SPAN = struct.Struct("!QQ")  # [lo, hi) of the helper's share of a two-process copy
READY = b"\x01"


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of ``parts`` near-equal pieces of n bytes (empty pieces dropped)."""
    edges = [n * i // parts for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo]


def _shared_file(size: int) -> tuple[str, mmap.mmap]:
    """A new file of ``size`` bytes in /dev/shm (the temp dir elsewhere), mapped."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(folder, f"pdserve-bench-memcpy-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        return path, mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _read_exact(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = os.read(fd, n - len(out))
        if not part:
            return out
        out += part
    return out


class MemcpyCeilings:
    """The three ways to copy up to ``max_bytes``: a thread pool and a helper process that
    live as long as this object. ``fns(payload)`` gives one callable per way; ``close``."""

    def __init__(self, max_bytes: int, threads: int | None = None) -> None:
        self.threads = threads or os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="bench-memcpy")
        (src_path, self._src_map), (dst_path, self._dst_map) = _shared_file(max_bytes), _shared_file(max_bytes)
        try:
            self._helper = subprocess.Popen(
                [sys.executable, "-m", "bench.transfer_memcpy", src_path, dst_path, str(max_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            if _read_exact(self._helper.stdout.fileno(), 1) != READY:
                raise RuntimeError("the memcpy helper process exited (see its stderr above)")
        finally:  # both processes hold the mappings now (or the helper failed): no name is left
            os.unlink(src_path)
            os.unlink(dst_path)
        self._src = np.frombuffer(self._src_map, dtype=np.uint8)  # [max_bytes]
        self._dst = np.frombuffer(self._dst_map, dtype=np.uint8)  # [max_bytes]

    def fns(self, payload: bytes) -> dict[str, Callable[[], None]]:
        """``memcpy_<way>`` -> one copy of ``payload``'s bytes, for each of WAYS."""
        n = len(payload)
        src = np.frombuffer(payload, dtype=np.uint8)  # [n]
        staging = np.empty(n, dtype=np.uint8)
        np.copyto(staging, src)  # the pages are touched before the timing, as in a reused buffer
        pieces = [(staging[lo:hi], src[lo:hi]) for lo, hi in chunk_bounds(n, self.threads)]
        np.copyto(self._src[:n], src)
        np.copyto(self._dst[:n], src)
        half = n // 2

        def threads() -> None:
            for f in [self._pool.submit(np.copyto, dst, s) for dst, s in pieces]:
                f.result()

        def two_process() -> None:
            os.write(self._helper.stdin.fileno(), SPAN.pack(half, n))
            np.copyto(self._dst[:half], self._src[:half])
            if _read_exact(self._helper.stdout.fileno(), 1) != READY:
                raise RuntimeError("the memcpy helper process exited")

        return {"memcpy_one_thread": lambda: np.copyto(staging, src), "memcpy_threads": threads,
                "memcpy_two_process": two_process}

    def close(self) -> None:
        self._pool.shutdown()
        self._helper.stdin.close()
        self._helper.wait(timeout=30)
        self._helper.stdout.close()
        self._src = self._dst = None  # the arrays' buffer exports must go before the maps close
        self._src_map.close()
        self._dst_map.close()


def _helper(src_path: str, dst_path: str, size: int) -> None:
    """The second process of a two-process copy: [lo, hi) spans on stdin, one byte back after
    copying each from the source file's map into the destination's."""
    with open(src_path, "rb") as f:
        src = np.frombuffer(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ), dtype=np.uint8)
    with open(dst_path, "r+b") as f:
        dst = np.frombuffer(mmap.mmap(f.fileno(), size), dtype=np.uint8)
    os.write(1, READY)
    while len(msg := _read_exact(0, SPAN.size)) == SPAN.size:
        lo, hi = SPAN.unpack(msg)
        np.copyto(dst[lo:hi], src[lo:hi])
        os.write(1, READY)


if __name__ == "__main__":
    _helper(sys.argv[1], sys.argv[2], int(sys.argv[3]))
