"""``KVTiers``: the host and disk tiers below one engine's device pool, and the moves between them.

The device pool's block pool stays the one source of truth for what the engine holds and who
references it (refcounts, chained hashes); the tiers hold *copies* of cached blocks, keyed by the
same chained hash, with the token ids kept to verify a hit exactly as the device cache does::

         device pool (BlockPool)                  host tier (HostTier)          disk tier (DiskTier)
    cache_full_block(b) --on_cached--> queued --copier thread--> slot ready --evicted--> file
                                       (b pinned while copied)       |    writer thread  .kvb
    allocate() evicts b: nothing to copy, the host already has it    |
                                                                     |
    lookup: device hits, then  <------ host hit (verified) ----------+
                               <------ disk hit: read into a host slot now (checksummed)
    allocate_slots: fresh device blocks for the host/disk hits; (slot, block) swap-ins
    model runner: copies the swap-ins in before the step's forward pass; then they are ordinary
    cached device blocks (registered after the step, like computed ones)

Everything here runs on the engine thread, except the two ``TierWorker`` threads, which only
copy and write bytes and hand results back (``service`` takes them). Torch-free: the copies are
callables from ``engine/kv_tiers/mover.py``.

Moving down never waits in a step: a block becomes a host copy when it becomes cached (write
through, a batched copy by the copier thread while the engine steps on; the device block keeps
one extra reference until the copy is done, at most ``max_inflight`` blocks at once, and an
allocation that would fail for want of them first waits for the copier); a host entry evicted by
LRU is written to disk by the writer thread (its slot is reused once the file is complete), and
with a disk tier a few slots are kept free ahead of need so an offload rarely waits for a write.

Events: every block entering or leaving a tier is a ``BlockStored`` / ``BlockRemoved`` with its
``tier`` (kv_index/events.py), appended to the pool's event list in order.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from engine.block_pool import BlockPool, KVBlock
from engine.kv_tiers.block_file import BlockFileError
from engine.kv_tiers.disk import DiskEntry, DiskTier, delete_file, error_reason, write_block_file
from engine.kv_tiers.host import HostEntry, HostTier
from engine.kv_tiers.stats import TierStats
from engine.kv_tiers.worker import TierWorker
from kv_index.events import TIER_DISK, TIER_HOST, BlockRemoved, BlockStored
from tokens.block_hash import BlockHash, hash_block_tokens

log = logging.getLogger(__name__)

# Seconds ``flush`` waits for the copier (a memcpy of at most max_inflight blocks).
FLUSH_TIMEOUT_S = 30.0
# Threads reading the files of one lookup's disk hits at once (I/O: they release the GIL).
READ_THREADS = 4


class TierHit(NamedTuple):
    """A block found below the device pool, now held in a ready host slot."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]
    entry: HostEntry
    source: int  # TIER_HOST, or TIER_DISK when the lookup read it in from a file


class KVTiers:
    """``copy_out(pairs, ready)`` copies (device block, host slot) pairs out of the pool (on the
    copier thread); ``ready_event()`` marks, on the engine thread, the point after which the
    blocks handed over are final; ``slot_view(slot)`` is a slot's bytes. ``bind`` attaches the
    device pool before use."""

    def __init__(self, host: HostTier, disk: DiskTier | None, block_bytes: int,
                 copy_out: Callable[[list[tuple[int, int]], Any], None], slot_view: Callable[[int], memoryview],
                 ready_event: Callable[[], Any] = lambda: None, max_inflight: int = 64,
                 copier: TierWorker | None = None, writer: TierWorker | None = None) -> None:
        self.host = host
        self.disk = disk
        self.block_bytes = block_bytes
        self._copy_out = copy_out
        self.slot_view = slot_view
        self._ready_event = ready_event
        self.max_inflight = max(1, max_inflight)
        self.copier = copier or TierWorker("kv-tier-copier")
        self.writer = writer or (TierWorker("kv-tier-writer") if disk is not None else None)
        # With a disk tier, evicting a host entry means a write; keep this many slots free or
        # on their way to free, so a new offload rarely finds none.
        self.spill_ahead = max(1, host.num_slots // 16) if disk is not None else 0
        self.pool: BlockPool | None = None
        self._to_offload: OrderedDict[BlockHash, BlockHash | None] = OrderedDict()  # hash -> parent
        self.device_pins = 0  # device blocks referenced by copies in flight
        self.stats = {TIER_HOST: TierStats(), TIER_DISK: TierStats()}
        self.closed = False
        self._readers: ThreadPoolExecutor | None = None  # made on the first multi-file read
        if disk is not None and not disk.admitting:  # e.g. a budget smaller than one block file
            self.stats[TIER_DISK].error(disk.stopped_reason)

    # ---- wiring
    def bind(self, pool: BlockPool) -> None:
        self.pool = pool
        pool.on_cached = self.on_cached

    def set_notifier(self, fn: Callable[[], None] | None) -> None:
        """Called from a worker thread whenever a job finished: wake the engine loop."""
        self.copier.on_done = fn
        if self.writer is not None:
            self.writer.on_done = fn

    @property
    def busy(self) -> bool:
        """Work the engine thread has to come back for: copies or writes in flight or
        finished but not yet taken, or blocks queued for the host tier."""
        return bool(self._to_offload) or self.copier.busy or (self.writer is not None and self.writer.busy)

    def close(self) -> None:
        """Finish the queued copies and file writes, then stop the threads; idempotent. The
        tiers still answer lookups afterwards but take no more blocks."""
        if self.closed:
            return
        self.copier.close()
        if self.writer is not None:
            self.writer.close()
        self._take_results()
        self.closed = True
        if self._readers is not None:
            self._readers.shutdown()
        self._to_offload.clear()
        if self.disk is not None:
            self.disk.close()  # takes no more blocks

    def _emit(self, ev) -> None:
        self.pool.emit(ev)

    # ---- warm start
    def warm_start(self) -> None:
        """Register the disk tier's files from an earlier life (events with tier disk)."""
        if self.disk is None:
            return
        res = self.disk.scan()
        for entry in res.kept:
            self._emit(BlockStored((entry.block_hash,), entry.parent_hash, (entry.token_ids,), TIER_DISK))
        for reason, n in res.refused.items():
            label = "foreign" if reason == "symlink" else reason  # a link is no file of ours either
            self.stats[TIER_DISK].errors[label] = self.stats[TIER_DISK].errors.get(label, 0) + n
        if res.refused:
            log.warning("disk KV cache %s: refused %s (another model, block size, shape or dtype wrote them: kept in "
                        "the budget, evicted first; symlinks are never followed)", self.disk.directory,
                        ", ".join(f"{n} {r}" for r, n in sorted(res.refused.items())))
        if res.kept or res.removed or res.evicted:
            log.info("disk KV cache %s: %d blocks re-registered, %d damaged, torn (%d) or stray files removed, %d over "
                     "the budget removed", self.disk.directory, len(res.kept), res.removed, res.torn, res.evicted)

    # ---- moving down
    def on_cached(self, block: KVBlock, parent_hash: BlockHash | None) -> None:
        """The pool registered ``block`` (BlockPool.on_cached): queue it for the host tier."""
        h = block.block_hash
        if h is not None and not self.host.holds(h):
            self._to_offload[h] = parent_hash

    def service(self) -> None:
        """Take finished copies and writes, then start the queued offloads. Engine thread;
        cheap when idle (the engine calls it around every step)."""
        self._take_results()
        if self.closed:
            return
        self._submit_offloads()
        self._keep_room()

    def _take_results(self) -> None:
        for token, ok, result, _ in self.copier.take_done():
            self._offloaded(token, ok, result)
        if self.writer is not None:
            for token, ok, result, _ in self.writer.take_done():
                self._written(token, ok, result)

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Wait for the copies in flight and release their device blocks (an allocation is
        short of free blocks and some are held only by copies)."""
        self.copier.wait_idle(timeout)
        for token, ok, result, _ in self.copier.take_done():
            self._offloaded(token, ok, result)

    def _submit_offloads(self) -> None:
        pool = self.pool
        pairs: list[tuple[int, int]] = []
        blocks: list[tuple[KVBlock, HostEntry]] = []
        while self._to_offload and self.device_pins + len(blocks) < self.max_inflight:
            h, parent = next(iter(self._to_offload.items()))
            block = pool.cached.get(h)
            if block is None or self.host.holds(h):
                self._to_offload.popitem(last=False)
                if block is None:  # evicted from the pool before its turn: its KV is gone
                    self.stats[TIER_HOST].skipped += 1
                continue
            entry = self._host_slot(h, parent, block.token_ids)
            if entry is None:
                break  # no slot until a copy or a file write finishes: it waits its turn
            self._to_offload.popitem(last=False)
            blocks.append((block, entry))
            pairs.append((block.block_id, entry.slot))
        if not blocks:
            return
        pool.touch(b for b, _ in blocks)
        self.device_pins += len(blocks)
        ready = self._ready_event()
        self.copier.submit(("offload", blocks), lambda: self._copy_out(pairs, ready))

    def _offloaded(self, token, ok: bool, err) -> None:
        _, blocks = token
        self.pool.free(b for b, _ in reversed(blocks))
        self.device_pins -= len(blocks)
        st = self.stats[TIER_HOST]
        if not ok:
            log.error("copying %d KV blocks to the host tier failed: %r", len(blocks), err)
            st.error("io_error")
            for _, entry in blocks:
                self.host.cancel(entry.slot)
            return
        stored = [e for _, e in blocks if self.host.filled(e.slot) is not None]
        st.offload_bytes += len(blocks) * self.block_bytes
        for e in stored:
            self._emit(BlockStored((e.block_hash,), e.parent_hash, (e.token_ids,), TIER_HOST))

    def _host_slot(self, h: BlockHash, parent: BlockHash | None, token_ids, now: bool = False) -> HostEntry | None:
        """A slot reserved for ``h``, evicting the least recently used unpinned entry when none
        is free. None when there is none, or when that entry must first be written to disk (its
        slot frees once the file is complete). ``now`` (a lookup reading a disk hit, which
        cannot wait): such an entry is dropped instead of written down."""
        entry = self.host.reserve(h, parent, token_ids)
        if entry is None:
            victim = next((e for e in self.host.lru() if not e.pins), None)
            if victim is not None and not self._evict_host(victim, may_spill=not now):
                entry = self.host.reserve(h, parent, token_ids)
        return entry

    def _evict_host(self, entry: HostEntry, may_spill: bool = True) -> bool:
        """Evict a ready, unpinned host entry; True when it goes to disk first (its slot is
        not free yet)."""
        disk = self.disk
        spill = may_spill and disk is not None and disk.admitting and entry.block_hash not in disk.entries
        planned = disk.plan_write(entry.block_hash, entry.parent_hash, entry.token_ids) if spill else None
        if spill and planned is None:
            self.stats[TIER_DISK].skipped += 1
        spill = planned is not None
        self.host.evict(entry, spill=spill)
        self._emit(BlockRemoved((entry.block_hash,), TIER_HOST))
        if planned is not None:
            disk_entry, evicted = planned
            self._drop_disk_files(evicted)
            path, temp = disk.path(entry.block_hash), disk.temp_path(entry.block_hash)
            view, layout = self.slot_view(entry.slot), disk.layout
            self.writer.submit(("spill", entry.slot, disk_entry), lambda: write_block_file(
                path, temp, layout, entry.block_hash, entry.parent_hash, entry.token_ids, view))
        return spill

    def _keep_room(self) -> None:
        if not self.spill_ahead:
            return
        while self.host.num_free + self.host.num_spilling < self.spill_ahead:
            victim = next((e for e in self.host.lru() if not e.pins), None)
            if victim is None:
                return
            self._evict_host(victim)

    def _written(self, token, ok: bool, result) -> None:
        if token[0] == "delete":
            if not ok:
                log.warning("could not delete a disk KV cache file: %r", result)
            return
        _, slot, entry = token
        self.host.spilled(slot)
        disk, st = self.disk, self.stats[TIER_DISK]
        disk.written(entry, ok)
        if ok:
            st.offload_bytes += result
            self._emit(BlockStored((entry.block_hash,), entry.parent_hash, (entry.token_ids,), TIER_DISK))
            return
        reason = error_reason(result)
        st.error(reason)
        disk.write_failed(reason, f"writing a block file failed: {result!r}")

    def _drop_disk_files(self, entries: Sequence[DiskEntry]) -> None:
        for e in entries:
            if e.ready and not e.foreign:  # another layout's file was never announced
                self._emit(BlockRemoved((e.block_hash,), TIER_DISK))
            self._delete(self.disk.path(e.block_hash))

    def _delete(self, path) -> None:
        if self.closed:
            delete_file(path)
        else:
            self.writer.submit(("delete",), lambda: delete_file(path))

    # ---- bringing back
    def lookup(self, parent: BlockHash | None, token_ids: Sequence[int], first_block: int, max_blocks: int,
               block_size: int, extra_key: bytes) -> list[TierHit]:
        """Leading blocks ``first_block .. max_blocks - 1`` of ``token_ids`` (chained from
        ``parent``, the hash of the block before ``first_block``) found in the host tier, or on
        disk (read into host slots now, several files at once: a corrupt or unreadable file is a
        miss there, its entry dropped). Stops at the first miss. Takes no pins: use the hits
        before anything else can evict them (``KVCacheManager.allocate_slots`` pins them)."""
        # 1. The chain as far as some tier holds it; host hits pinned at once, so reserving
        #    slots for the disk hits below cannot evict a later block of this same prompt.
        plan: list[list] = []  # [hash, parent, chunk, host entry or None, disk entry or None]
        pinned: list[HostEntry] = []
        for i in range(first_block, max_blocks):
            chunk = tuple(token_ids[i * block_size:(i + 1) * block_size])
            h = hash_block_tokens(parent, chunk, extra_key)
            entry = self.host.get(h, chunk)
            found = self.disk.get(h, chunk) if entry is None and self.disk is not None else None
            if entry is None and found is None:
                break
            if entry is not None:
                entry.pins += 1
                pinned.append(entry)
            plan.append([h, parent, chunk, entry, found])
            parent = h
        try:
            # 2. A host slot for each disk hit; the lookup cannot wait for a write, so a victim
            #    that would need one is dropped instead. No slot: the hit ends there.
            for n, item in enumerate(plan):
                if item[3] is None:
                    item[3] = self._host_slot(item[0], item[1], item[2], now=True)
                    if item[3] is None:
                        self.stats[TIER_HOST].skipped += 1
                        del plan[n:]
                        break
        finally:
            self.unpin(pinned)
        reads = self._read_files([(found, entry) for _, _, _, entry, found in plan if found is not None])
        hits: list[TierHit] = []
        missed = False
        for h, parent, chunk, entry, found in plan:
            if found is not None:
                entry = self._read_done(h, parent, chunk, entry, found, reads[h])
            missed = missed or entry is None
            if missed:
                continue  # past a miss: blocks read after it stay host entries, but are no hits now
            self.host.touch(entry)
            hits.append(TierHit(h, chunk, entry, TIER_DISK if found is not None else TIER_HOST))
        return hits

    def _read_files(self, reads: list[tuple[DiskEntry, HostEntry]]) -> dict:
        """Read each file into its reserved host slot, several at once -> hash -> (error or
        None, seconds). Only I/O and checks here: the bookkeeping stays on the engine thread."""
        def one(item):
            found, entry = item
            t0 = time.perf_counter()
            try:
                self.disk.read_file(found, self.slot_view(entry.slot))
                err = None
            except (BlockFileError, OSError) as e:
                err = e
            return found.block_hash, (err, time.perf_counter() - t0)

        if len(reads) <= 1:
            return dict(map(one, reads))
        if self._readers is None:
            self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-tier-read")
        return dict(self._readers.map(one, reads))

    def _read_done(self, h: BlockHash, parent: BlockHash | None, chunk: tuple[int, ...], entry: HostEntry,
                   found: DiskEntry, result: tuple) -> HostEntry | None:
        """Account for one file read into ``entry``'s slot: a ready host entry, or (the file was
        corrupt or unreadable) a miss, counted, the slot freed and the file dropped."""
        err, seconds = result
        st = self.stats[TIER_DISK]
        if err is not None:
            self.host.cancel(entry.slot)
            reason = err.reason if isinstance(err, BlockFileError) else error_reason(err)
            st.error("checksum" if reason in ("format", "torn") else reason)
            log.warning("disk KV cache: block %016x unusable (%s), recomputing it: %s", h, reason, err)
            self.disk.remove(found)
            self._drop_disk_files([found])
            return None
        st.onboard_seconds.observe(seconds)
        st.onboard_bytes += self.block_bytes
        self.disk.touch(h)
        ready = self.host.filled(entry.slot)
        self._emit(BlockStored((h,), parent, (chunk,), TIER_HOST))
        return ready

    def touch(self, hashes) -> None:
        """Device hits: their copies in the lower tiers become the most recently used."""
        for h in hashes:
            entry = self.host.entries.get(h)
            if entry is not None:
                self.host.touch(entry)
            if self.disk is not None:
                self.disk.touch(h)

    def pin(self, hits: Sequence[TierHit]) -> None:
        for hit in hits:
            hit.entry.pins += 1

    def unpin(self, entries: Sequence[HostEntry]) -> None:
        for e in entries:
            e.pins -= 1

    def check(self, hits: Sequence[TierHit]) -> bool:
        """Whether every hit is still the ready host entry of its hash."""
        return all(self.host.entries.get(h.block_hash) is h.entry for h in hits)

    def count_onboard(self, hits: Sequence[TierHit]) -> None:
        """``hits`` are being brought into the device pool: count them per source tier."""
        for hit in hits:
            self.stats[hit.source].hits += 1
        self.stats[TIER_HOST].onboard_bytes += len(hits) * self.block_bytes

    # ---- reset and figures
    def clear(self) -> None:
        """Forget everything the tiers hold (the pool's reset emitted AllBlocksCleared)."""
        self._to_offload.clear()
        self.host.clear()
        if self.disk is not None:
            for e in self.disk.clear():
                self._delete(self.disk.path(e.block_hash))

    def snapshot(self) -> dict:
        host, disk = self.host, self.disk
        out = {"host": self.stats[TIER_HOST].snapshot(host.num_ready, host.num_slots, self.block_bytes)}
        if disk is not None:
            out["disk"] = {**self.stats[TIER_DISK].snapshot(disk.num_ready, disk.budget_bytes // disk.file_bytes,
                                                            disk.file_bytes),
                           "admitting": disk.admitting}
        return out
