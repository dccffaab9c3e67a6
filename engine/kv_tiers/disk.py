"""The disk tier: one file per cached block in a directory, under a byte budget, LRU by access.

Bookkeeping (``DiskTier``) runs on the engine thread; file writes and deletions run on the
tier's writer thread (``write_block_file``, ``delete_file``: plain functions of bytes and
paths); reads run on the engine thread when a prefix lookup reaches a disk hit
(``DiskTier.read_into``). Torch-free: a payload is any buffer.

Files are written atomically: the bytes go to ``.{hash}.{pid}.tmp`` and are renamed to
``{hash}.kvb`` once complete, so a crash leaves a stray temporary file (removed at the next
start) and never a short block file. No fsync: a block file lost or torn by a power cut is a
checksum failure, that is a miss.

An entry is ``writing`` (its bytes reserved in the budget, not yet a hit) or ready. The LRU
order survives restarts through the files' modification times: a hit touches its file.

At start the directory is scanned (headers only): files of this engine's layout are
registered, stray temporary files and our own corrupt files removed, and files written by
another model, block size, shape, dtype or format version left alone (another engine's cache
is not ours to delete), counted, and reported once.
"""
from __future__ import annotations

import errno
import fcntl
import io
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.kv_tiers.block_file import (
    BlockFileError,
    BlockHeader,
    KVLayout,
    check_layout,
    encode_header,
    file_name,
    hash_of_name,
    payload_checksum,
    read_header,
)

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


def error_reason(err: BaseException) -> str:
    """The metric label of a failed file operation: ``no_space`` for a full disk or quota,
    ``io_error`` for anything else the OS refused."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "no_space"
    return "io_error"


@dataclass(slots=True, eq=False)
class DiskEntry:
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    nbytes: int
    ready: bool = True


@dataclass(slots=True)
class ScanResult:
    """What the start-up scan found; ``refused`` maps a reason to its file count."""

    kept: list[DiskEntry] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)
    removed: int = 0  # our own corrupt files and stray temporary files, deleted
    evicted: int = 0  # files over the budget (the oldest), deleted
    first_refusal: str = ""


class DiskTier:
    """``directory`` is created if missing and locked for this process (one engine per
    directory: two would evict each other's files). Raises ``RuntimeError`` when another
    process holds it."""

    def __init__(self, directory: str | os.PathLike, budget_bytes: int, layout: KVLayout,
                 element_size_of: Callable[[str], int | None]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        self.budget_bytes = budget_bytes
        self._element_size_of = element_size_of
        header = encode_header(layout, 0, 0, [0] * layout.block_size, layout.block_bytes, 0)
        self.file_bytes = len(header) + layout.block_bytes
        self.entries: OrderedDict[int, DiskEntry] = OrderedDict()  # LRU: head = least recently used
        self.used_bytes = 0
        self.num_ready = 0  # entries whose file is complete (the others are being written)
        # False once the disk refused a write (full, failing) or a block cannot fit the budget:
        # the tier then stops taking blocks, keeps serving the ones it has.
        self.admitting = True
        self.stopped_reason: str | None = None
        self._lock = open(self.directory / LOCK_NAME, "a+b")  # noqa: SIM115 (held for the engine's life)
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise RuntimeError(f"disk cache directory {self.directory} is in use by another process "
                               "(give each node a directory of its own)") from None
        if self.file_bytes > budget_bytes:
            self.stop_admitting("no_space", f"one block file takes {self.file_bytes} bytes, more than the "
                                f"disk cache budget of {budget_bytes}")

    def close(self) -> None:
        self._lock.close()

    # ---- paths
    def path(self, block_hash: int) -> Path:
        return self.directory / file_name(block_hash)

    def temp_path(self, block_hash: int) -> Path:
        return self.directory / f".{block_hash:016x}.{os.getpid()}.tmp"

    # ---- start
    def scan(self) -> ScanResult:
        """Register the usable files already in the directory (see the module docstring)."""
        res = ScanResult()
        found: list[tuple[int, DiskEntry]] = []  # (mtime ns, entry)
        for p in sorted(self.directory.iterdir()):
            name = p.name
            if name.startswith(".") and name.endswith(".tmp"):
                _unlink(p)
                res.removed += 1
                continue
            block_hash = hash_of_name(name)
            if block_hash is None or not p.is_file():
                continue
            header, why = self._scan_one(p, block_hash)
            if header is None:
                if why == "checksum":
                    _unlink(p)
                    res.removed += 1
                else:
                    res.refused[why] = res.refused.get(why, 0) + 1
                continue
            entry = DiskEntry(header.block_hash, header.parent_hash, header.token_ids, self.file_bytes)
            found.append((p.stat().st_mtime_ns, entry))
        found.sort(key=lambda x: x[0])
        total = sum(e.nbytes for _, e in found)
        for _, entry in found:
            if total > self.budget_bytes:
                _unlink(self.path(entry.block_hash))
                total -= entry.nbytes
                res.evicted += 1
                continue
            self.entries[entry.block_hash] = entry
            self.used_bytes += entry.nbytes
            self.num_ready += 1
            res.kept.append(entry)
        return res

    def _scan_one(self, p: Path, block_hash: int) -> tuple[BlockHeader | None, str]:
        try:
            with open(p, "rb") as f:
                header = read_header(f, self._element_size_of)
        except BlockFileError as err:
            # Another format's file is not ours to judge; a bad checksum in ours is damage.
            return None, "checksum" if err.reason == "checksum" else "foreign"
        except OSError:
            return None, "io_error"
        if header.block_hash != block_hash:
            return None, "checksum"
        why = check_layout(header, self.layout)
        if why is not None:
            log.debug("disk cache file %s refused: %s", p, why)
            return None, "foreign"
        return header, ""

    # ---- lookups
    def get(self, block_hash: int, token_ids: Sequence[int]) -> DiskEntry | None:
        """The ready entry of ``block_hash`` if its token ids equal ``token_ids``."""
        entry = self.entries.get(block_hash)
        if entry is None or not entry.ready or entry.token_ids != tuple(token_ids):
            return None
        return entry

    def touch(self, block_hash: int) -> None:
        """``block_hash`` was used: it becomes the most recently used."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)

    def read_file(self, entry: DiskEntry, into: memoryview) -> None:
        """Read ``entry``'s KV into ``into`` (``layout.block_bytes`` bytes), checking the header
        against this engine's layout, the hash and tokens, and both checksums, and touch the
        file (the LRU order a restart reads back). Changes no bookkeeping, so reads of several
        files may run on several threads at once. Raises ``BlockFileError`` (``checksum`` or
        ``format``) or ``OSError``; the caller drops the entry then."""
        path = self.path(entry.block_hash)
        head = bytearray(self.file_bytes - self.layout.block_bytes)
        fd = os.open(path, os.O_RDONLY)
        try:
            # One read for header and payload: a file of this layout has exactly this header.
            n = os.readv(fd, [head, into]) - len(head)
            header = read_header(io.BytesIO(head), self._element_size_of)
            if check_layout(header, self.layout) is not None:
                raise BlockFileError("format", f"{path} was replaced by another engine's file")
            if header.block_hash != entry.block_hash or header.token_ids != entry.token_ids:
                raise BlockFileError("checksum", f"{path} no longer holds block {entry.block_hash:#x}")
            if n != header.payload_len or header.header_len != len(head):
                raise BlockFileError("format", f"{path}: payload of {n} bytes, expected {header.payload_len}")
            if payload_checksum(into) != header.payload_checksum:
                raise BlockFileError("checksum", f"{path}: payload checksum mismatch")
            try:
                os.utime(fd)  # the LRU order a restart reads back
            except OSError:
                pass  # recency is a hint
        finally:
            os.close(fd)

    # ---- writes
    def plan_write(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]
                   ) -> tuple[DiskEntry, list[DiskEntry]] | None:
        """Reserve room for one block file: -> (its entry, now ``writing``; the ready entries
        evicted to make room, least recently used first, whose files the caller deletes), or
        None when the tier does not admit or cannot make room now (every other entry is still
        being written)."""
        if not self.admitting or block_hash in self.entries:
            return None
        evicted: list[DiskEntry] = []
        need = self.used_bytes + self.file_bytes - self.budget_bytes
        if need > 0:
            for old in list(self.entries.values()):
                if need <= 0:
                    break
                if old.ready:
                    evicted.append(old)
                    need -= old.nbytes
            if need > 0:
                return None
        for old in evicted:
            self.remove(old)
        entry = DiskEntry(block_hash, parent_hash, tuple(token_ids), self.file_bytes, ready=False)
        self.entries[block_hash] = entry
        self.used_bytes += entry.nbytes
        return entry, evicted

    def written(self, entry: DiskEntry, ok: bool) -> None:
        """The write of ``entry`` finished (``ok``) or failed (its bytes are released)."""
        if self.entries.get(entry.block_hash) is not entry:
            return  # cleared meanwhile
        if ok:
            entry.ready = True
            self.num_ready += 1
        else:
            self.remove(entry)

    def remove(self, entry: DiskEntry) -> None:
        """Forget ``entry`` (the caller deletes its file)."""
        if self.entries.get(entry.block_hash) is entry:
            del self.entries[entry.block_hash]
            self.used_bytes -= entry.nbytes
            self.num_ready -= entry.ready

    def stop_admitting(self, reason: str, why: str) -> None:
        if self.admitting:
            log.warning("disk KV cache in %s stops taking blocks (%s): %s; it keeps serving the %d it holds",
                        self.directory, reason, why, len(self.entries))
        self.admitting = False
        self.stopped_reason = reason

    def clear(self) -> list[DiskEntry]:
        """Forget every ready entry; returns them (the caller deletes their files)."""
        gone = [e for e in self.entries.values() if e.ready]
        for e in gone:
            self.remove(e)
        return gone


def write_block_file(final: Path, temp: Path, layout: KVLayout, block_hash: int, parent_hash: int | None,
                     token_ids: Sequence[int], payload: memoryview) -> int:
    """Write one block file atomically (temporary file, then rename); returns the bytes
    written. Raises ``OSError`` (the temporary file is removed)."""
    header = encode_header(layout, block_hash, parent_hash, token_ids, len(payload), payload_checksum(payload))
    try:
        with open(temp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(temp, final)
    except BaseException:
        _unlink(temp)
        raise
    return len(header) + len(payload)


def delete_file(path: Path) -> None:
    _unlink(path)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
