"""The disk tier: one file per cached block in a directory, under a byte budget, LRU by access.

Bookkeeping (``DiskTier``) runs on the engine thread; file writes and deletions run on the
tier's writer thread (``write_block_file``, ``delete_file``: plain functions of bytes and
paths); reads run on the engine thread when a prefix lookup reaches a disk hit
(``DiskTier.read_into``). Torch-free: a payload is any buffer.

Files are written atomically: the bytes go to ``.{hash}.{pid}.tmp`` and are renamed to
``{hash}.kvb`` once complete, so a crash leaves a stray temporary file (removed at the next
start) and never a short block file. No fsync: a power cut can still leave a block file torn
(empty or cut short); the next start's scan deletes it, and a read of one is a miss.

The files hold the prompts' token ids: the directory is made (or narrowed to) 0700 and every
file is created 0600 (older files are narrowed at the scan), whatever the umask. Nothing in it is
followed as a symlink (``O_NOFOLLOW`` on every open; a temporary file is created fresh with
``O_EXCL``): a link planted in the directory can neither make the tier read another file as a
block nor write through it.

An entry is ``writing`` (its bytes reserved in the budget, not yet a hit) or ready. The LRU
order survives restarts through the files' modification times: a hit touches its file.

At start the directory is scanned (headers only): files of this engine's layout are
registered, stray temporary files, torn files and our own corrupt files removed, symlinks
refused. Files written by another model, block size, shape, dtype or format version are counted,
reported once and kept in the budget as the least recently used entries: evicted first when room
is needed (they are never hits here), so a directory reused across models stays under budget.

A failed write (a full or failing disk) pauses the tier for ``retry_s[0]`` seconds, doubling
with each pause in a row up to ``retry_s[1]``; the next write after the pause is the retry, and
a write that succeeds ends the backoff. Meanwhile the tier serves what it holds. Only a budget
smaller than one file stops it for good.
"""
from __future__ import annotations

import errno
import fcntl
import io
import logging
import os
import stat
import time
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
FILE_MODE = 0o600  # token ids are prompts: nobody but the node's user reads them
DIR_MODE = 0o700
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
# Seconds a failed write pauses the tier, doubling per pause in a row up to the cap: a full disk
# often frees up (logs rotated, another cache evicted); a failing one costs one write per pause.
WRITE_RETRY_S = (5.0, 300.0)


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
    foreign: bool = False  # another layout's file: counted in the budget, never a hit


@dataclass(slots=True)
class ScanResult:
    """What the start-up scan found; ``refused`` maps a reason to its file count."""

    kept: list[DiskEntry] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)
    removed: int = 0  # our own corrupt files, torn files and stray temporary files, deleted
    torn: int = 0  # of removed: block files cut short (a crash or power cut)
    evicted: int = 0  # files over the budget (other layouts' first, then the oldest), deleted
    foreign: list[DiskEntry] = field(default_factory=list)  # other layouts' files, kept in the budget
    first_refusal: str = ""


class DiskTier:
    """``directory`` is created if missing (0700, or narrowed to it) and locked for this process
    (one engine per directory: two would evict each other's files). Raises ``RuntimeError`` when
    another process holds it. ``retry_s``: a failed write's pause and its cap (module docstring);
    ``clock``: monotonic seconds."""

    def __init__(self, directory: str | os.PathLike, budget_bytes: int, layout: KVLayout,
                 element_size_of: Callable[[str], int | None], retry_s: tuple[float, float] = WRITE_RETRY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        _narrow(self.directory, DIR_MODE)
        self.layout = layout
        self.budget_bytes = budget_bytes
        self._element_size_of = element_size_of
        header = encode_header(layout, 0, 0, [0] * layout.block_size, layout.block_bytes, 0)
        self.file_bytes = len(header) + layout.block_bytes
        self.entries: OrderedDict[int, DiskEntry] = OrderedDict()  # LRU: head = least recently used
        self.used_bytes = 0
        self.num_ready = 0  # entries whose file is complete (the others are being written)
        # Not admitting (``admitting``): paused after a failed write until ``_paused_until``, or
        # stopped for good (a block cannot fit the budget, or closed). It keeps serving meanwhile.
        self.retry_s = retry_s
        self.clock = clock
        self._paused_until: float | None = None
        self._pauses = 0  # pauses in a row, since the last write that succeeded
        self._stopped = False
        self.stopped_reason: str | None = None
        self._lock = open(self.directory / LOCK_NAME, "a+b", opener=_private_opener)  # noqa: SIM115 (held for life)
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
        self._stopped = True
        self._lock.close()

    @property
    def admitting(self) -> bool:
        """Whether the tier takes new blocks now: not stopped, and any pause has passed."""
        if self._stopped:
            return False
        if self._paused_until is not None:
            if self.clock() < self._paused_until:
                return False
            self._paused_until = None
            log.info("disk KV cache in %s takes blocks again (the next write retries)", self.directory)
        return True

    # ---- paths
    def path(self, block_hash: int) -> Path:
        return self.directory / file_name(block_hash)

    def temp_path(self, block_hash: int) -> Path:
        return self.directory / f".{block_hash:016x}.{os.getpid()}.tmp"

    # ---- start
    def scan(self) -> ScanResult:
        """Register the files already in the directory (see the module docstring): ours as
        ready entries, other layouts' as foreign ones at the head of the LRU order."""
        res = ScanResult()
        ours: list[tuple[int, DiskEntry]] = []  # (mtime ns, entry)
        foreign: list[tuple[int, DiskEntry]] = []
        for p in sorted(self.directory.iterdir()):
            name = p.name
            if name.startswith(".") and name.endswith(".tmp"):
                _unlink(p)  # a symlink is unlinked, never followed
                res.removed += 1
                continue
            block_hash = hash_of_name(name)
            if block_hash is None:
                continue
            header, why, st = self._scan_one(p, block_hash)
            if why in ("checksum", "torn"):
                _unlink(p)
                res.removed += 1
                res.torn += why == "torn"
            elif why == "foreign":
                foreign.append((st.st_mtime_ns, DiskEntry(block_hash, None, (), st.st_size, foreign=True)))
            elif why:
                res.refused[why] = res.refused.get(why, 0) + 1
            elif header is not None:
                entry = DiskEntry(header.block_hash, header.parent_hash, header.token_ids, self.file_bytes)
                ours.append((st.st_mtime_ns, entry))
        if foreign:
            res.refused["foreign"] = len(foreign)
        self._register(res, [e for _, e in sorted(foreign, key=lambda x: x[0])],
                       [e for _, e in sorted(ours, key=lambda x: x[0])])
        return res

    def _register(self, res: ScanResult, foreign: list[DiskEntry], ours: list[DiskEntry]) -> None:
        """Enter the scanned files, least recently used first (other layouts' before ours),
        deleting from the head what does not fit the budget."""
        total = sum(e.nbytes for e in foreign) + sum(e.nbytes for e in ours)
        for entry in foreign + ours:
            if total > self.budget_bytes:
                _unlink(self.path(entry.block_hash))
                total -= entry.nbytes
                res.evicted += 1
                continue
            self.entries[entry.block_hash] = entry
            self.used_bytes += entry.nbytes
            if entry.foreign:
                res.foreign.append(entry)
            else:
                self.num_ready += 1
                res.kept.append(entry)

    def _scan_one(self, p: Path, block_hash: int) -> tuple[BlockHeader | None, str, os.stat_result | None]:
        """-> (header, "" if usable else why not, the file's stat). Symlinks are refused
        unopened; a file of ours with a mode wider than 0600 is narrowed."""
        try:
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                log.warning("disk cache %s: %s is a symlink, not followed", self.directory, p.name)
                return None, "symlink", st
            if not stat.S_ISREG(st.st_mode):
                return None, "", None  # a directory or device under our file name: not a block
            with open(p, "rb", opener=_nofollow_opener) as f:
                if st.st_mode & 0o077:
                    os.fchmod(f.fileno(), FILE_MODE)  # written by an older version with the umask's mode
                header = read_header(f, self._element_size_of)
        except BlockFileError as err:
            # Another format's file is not ours to judge; a bad checksum or a cut in ours is damage.
            return None, "foreign" if err.reason == "format" else err.reason, st
        except OSError:
            return None, "io_error", None
        if header.block_hash != block_hash:
            return None, "checksum", st
        if st.st_size != header.header_len + header.payload_len:
            return None, "torn", st  # the header survived, the payload did not (all of it)
        why = check_layout(header, self.layout)
        if why is not None:
            log.debug("disk cache file %s refused: %s", p, why)
            return None, "foreign", st
        return header, "", st

    # ---- lookups
    def get(self, block_hash: int, token_ids: Sequence[int]) -> DiskEntry | None:
        """The ready entry of ``block_hash`` if its token ids equal ``token_ids``."""
        entry = self.entries.get(block_hash)
        if entry is None or not entry.ready or entry.foreign or entry.token_ids != tuple(token_ids):
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
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)  # a link planted since the scan: ELOOP, a miss
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
            self._pauses = 0  # the disk takes writes again: the next failure pauses briefly
        else:
            self.remove(entry)

    def remove(self, entry: DiskEntry) -> None:
        """Forget ``entry`` (the caller deletes its file)."""
        if self.entries.get(entry.block_hash) is entry:
            del self.entries[entry.block_hash]
            self.used_bytes -= entry.nbytes
            self.num_ready -= entry.ready and not entry.foreign

    def stop_admitting(self, reason: str, why: str) -> None:
        """Stop taking blocks for good (a block that can never fit)."""
        if not self._stopped:
            log.warning("disk KV cache in %s stops taking blocks (%s): %s; it keeps serving the %d it holds",
                        self.directory, reason, why, len(self.entries))
        self._stopped = True
        self.stopped_reason = reason

    def write_failed(self, reason: str, why: str) -> None:
        """A write failed: pause (module docstring). Writes that were queued before the pause
        and fail during it do not lengthen it."""
        self.stopped_reason = reason
        now = self.clock()
        if self._stopped or (self._paused_until is not None and now < self._paused_until):
            return
        wait = min(self.retry_s[0] * 2 ** self._pauses, self.retry_s[1])
        self._pauses += 1
        self._paused_until = now + wait
        log.warning("disk KV cache in %s pauses for %.0f s (%s): %s; it keeps serving the %d it holds",
                    self.directory, wait, reason, why, len(self.entries))

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
        # A fresh file, 0600: whatever sat at the temporary name (a leftover, a planted link) is
        # unlinked first, and O_EXCL refuses anything that appears there meanwhile.
        _unlink(temp)
        with open(temp, "xb", opener=_private_opener) as f:
            f.write(header)
            f.write(payload)
        os.replace(temp, final)  # replaces a link at ``final`` itself, never its target
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


def _nofollow_opener(path, flags: int) -> int:
    return os.open(path, flags | _NOFOLLOW)


def _private_opener(path, flags: int) -> int:
    """``open(..., opener=)``: never through a link, created ``FILE_MODE`` whatever the umask."""
    fd = os.open(path, flags | _NOFOLLOW, FILE_MODE)
    if os.fstat(fd).st_mode & 0o077:
        os.fchmod(fd, FILE_MODE)  # an existing file (the lock) made by an older version
    return fd


def _narrow(directory: Path, mode: int) -> None:
    """Take group and other permissions off ``directory`` (it holds prompts' token ids)."""
    try:
        if directory.stat().st_mode & 0o777 & ~mode:
            os.chmod(directory, mode)
    except OSError as err:
        log.warning("disk KV cache %s: cannot make the directory private (%s); its files are 0600", directory, err)
