"""Cold reads for `pdserve bench kv-tiers`: taking files out of the page cache, and proving that a
read then came from storage rather than memory.

A read is *cold* when its bytes are fetched from the storage device, not copied out of the page
cache. Dropping a file's pages needs no root: once the file is clean (``fdatasync``),
``posix_fadvise(POSIX_FADV_DONTNEED)`` drops them. The kernel does not promise it (a page still
under writeback, or mapped, stays), so the drop is checked, not trusted: ``read_bytes`` in
``/proc/self/io`` counts the bytes this process (all its threads) caused to be read from the block
layer, and a read is proven cold when that count grew by at least ``COLD_FRACTION`` of the bytes it
read::

    before = read_proc_io()        read_bytes: 1_000_000
    ... read 184 MiB of files ...
    after  = read_proc_io()        read_bytes: 194_003_968   (+ >= 0.95 x 184 MiB: proven cold)

A page-cache read leaves ``read_bytes`` unchanged, and so does any read on a filesystem with no
block device under it (tmpfs, ramfs): there the proof fails and the figure is reported as not
proven, never as cold. Readahead and the 4 KiB page rounding of each file only add storage bytes
(a ratio a little above 1). A virtual disk whose host caches its image can still serve a "cold"
read from the host's memory; the guest cannot see that, so the filesystem and its source device are
reported beside the figures.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

COLD_FRACTION = 0.95  # storage bytes / bytes read at or above which a read counts as cold
PROC_IO = "/proc/self/io"
DROP_CACHES = "/proc/sys/vm/drop_caches"


class ColdProof(NamedTuple):
    """One read (or the sum of several) and what the block layer saw of it."""

    logical_bytes: int  # bytes the reader asked for and got
    storage_read_bytes: int | None  # read_bytes delta; None: /proc/self/io unreadable
    cold_proven: bool

    @property
    def storage_ratio(self) -> float | None:
        if self.storage_read_bytes is None or self.logical_bytes <= 0:
            return None
        return self.storage_read_bytes / self.logical_bytes

    def as_dict(self) -> dict:
        ratio = self.storage_ratio
        return {"cold_proven": self.cold_proven, "logical_bytes": self.logical_bytes,
                "storage_read_bytes": self.storage_read_bytes,
                "storage_ratio": None if ratio is None else round(ratio, 3)}


def parse_proc_io(text: str) -> dict[str, int]:
    """``/proc/<pid>/io`` text (``name: value`` lines) -> {name: value}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and value.strip().isdigit():
            out[name.strip()] = int(value)
    return out


def read_proc_io(path: str = PROC_IO) -> dict[str, int] | None:
    """This process's I/O counters, or None where the kernel does not provide them."""
    try:
        with open(path) as f:
            return parse_proc_io(f.read())
    except OSError:
        return None


def cold_proof(logical_bytes: int, before: dict[str, int] | None, after: dict[str, int] | None,
               fraction: float = COLD_FRACTION) -> ColdProof:
    """Whether reading ``logical_bytes`` between the two ``/proc/self/io`` readings came from
    storage: the ``read_bytes`` delta must reach ``fraction`` of them. A missing reading (or
    counter) proves nothing; neither does an empty read."""
    if before is None or after is None or "read_bytes" not in before or "read_bytes" not in after:
        return ColdProof(logical_bytes, None, False)
    delta = after["read_bytes"] - before["read_bytes"]
    return ColdProof(logical_bytes, delta, logical_bytes > 0 and delta >= fraction * logical_bytes)


def combine(proofs: Iterable[ColdProof]) -> ColdProof:
    """Several reads as one: bytes summed, proven only when every one of them is."""
    proofs = list(proofs)
    storage = [p.storage_read_bytes for p in proofs]
    return ColdProof(sum(p.logical_bytes for p in proofs),
                     None if not proofs or None in storage else sum(storage),  # type: ignore[arg-type]
                     bool(proofs) and all(p.cold_proven for p in proofs))


# ---- the filesystem under the bench directory

def _unescape(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def mount_of(path: str, mounts_text: str) -> dict | None:
    """The mount holding the absolute, resolved ``path``, from ``/proc/mounts`` text: the entry
    with the longest mount point above it (the last one listed when several are mounted on the
    same point: it hides the others). -> {mount_point, fstype, source, options} or None."""
    best: dict | None = None
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = _unescape(fields[1])
        inside = path == point or point == "/" or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best["mount_point"])):
            best = {"mount_point": point, "fstype": fields[2], "source": _unescape(fields[0]),
                    "options": fields[3]}
    return best


def filesystem_info(directory: Path) -> dict:
    """What the bench directory is on: its mount (from /proc/mounts), the filesystem's block
    size and free bytes (statvfs), whether /proc/self/io is readable and whether
    /proc/sys/vm/drop_caches is writable (reported only: the bench never writes it, which
    would empty every other process's cache too)."""
    resolved = os.path.realpath(directory)
    try:
        with open("/proc/mounts") as f:
            mount = mount_of(resolved, f.read())
    except OSError:
        mount = None
    st = os.statvfs(resolved)
    info = {"path": resolved, **(mount or {"mount_point": None, "fstype": None, "source": None}),
            "block_size": st.f_bsize, "free_bytes": st.f_bavail * st.f_frsize,
            "proc_io": read_proc_io() is not None, "drop_caches_writable": os.access(DROP_CACHES, os.W_OK)}
    info.pop("options", None)
    return info


# ---- syncing and dropping files

def fdatasync_files(paths: Iterable[Path]) -> None:
    """Wait until each file's data is on storage (one ``fdatasync`` each, in order)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)


def drop_cached_pages(paths: Iterable[Path]) -> None:
    """Ask the kernel to drop each file's pages from the page cache (``fdatasync`` first: dirty
    pages are not dropped). Whether it did is for ``cold_proof`` to tell."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
