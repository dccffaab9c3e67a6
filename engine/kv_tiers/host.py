"""The host tier's bookkeeping: which slot of the host buffer holds which cached block.

Plain data on slot numbers (no torch): ``engine/kv_tiers/mover.py`` owns the buffer the slots
index. A slot is in exactly one state::

    free      in the free list, holding nothing
    filling   reserved for a block whose KV is being copied in (from the device pool or
              from a disk file); not a hit yet
    ready     in ``entries`` under the block's hash, with its token ids: a hit, in LRU order
    spilling  evicted from ``entries``, its bytes still being written to disk; free once
              the write finished

A ready entry may be pinned (``pins > 0``): an onboarding copy or a peer's export reads it, so
it is not evicted. ``entries`` is the LRU: head = least recently stored or hit.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class HostEntry:
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    slot: int
    pins: int = 0
    on_disk: bool = False  # a ready copy exists in the disk tier: evicting this one costs no write


class HostTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._filling: dict[int, HostEntry] = {}
        self._spilling: set[int] = set()
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()

    # ---- state
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_ready(self) -> int:
        return len(self.entries)

    @property
    def num_spilling(self) -> int:
        return len(self._spilling)

    @property
    def num_used(self) -> int:
        """Slots not free: ready, filling and spilling ones."""
        return self.num_slots - len(self._free)

    def free_slots(self) -> list[int]:
        """The free list, next to be reserved first. For tests."""
        return list(self._free)

    def holds(self, block_hash: int) -> bool:
        """A ready entry, or one being filled (no second copy of it should start)."""
        return block_hash in self.entries or any(e.block_hash == block_hash for e in self._filling.values())

    def get(self, block_hash: int, token_ids: Sequence[int]) -> HostEntry | None:
        """The ready entry of ``block_hash`` if its token ids equal ``token_ids`` (no LRU change)."""
        entry = self.entries.get(block_hash)
        if entry is None or entry.token_ids != tuple(token_ids):
            return None
        return entry

    def touch(self, entry: HostEntry) -> None:
        """A hit: the entry becomes the most recently used."""
        self.entries.move_to_end(entry.block_hash)

    # ---- filling
    def reserve(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> HostEntry | None:
        """A free slot for ``block_hash``, now filling; None when no slot is free."""
        if not self._free:
            return None
        entry = HostEntry(block_hash, parent_hash, tuple(token_ids), self._free.popleft())
        self._filling[entry.slot] = entry
        return entry

    def filled(self, slot: int) -> HostEntry | None:
        """The copy into ``slot`` finished: its entry becomes ready (most recently used). Returns
        None, freeing the slot, when another entry of the same hash became ready meanwhile."""
        entry = self._filling.pop(slot)
        if entry.block_hash in self.entries:
            self._free.append(slot)
            return None
        self.entries[entry.block_hash] = entry
        return entry

    def cancel(self, slot: int) -> None:
        """The copy into ``slot`` failed: the slot is free again."""
        del self._filling[slot]
        self._free.append(slot)

    # ---- eviction
    def lru(self) -> Iterator[HostEntry]:
        """Ready entries, least recently used first (a snapshot: safe to evict while iterating)."""
        return iter(list(self.entries.values()))

    def evict(self, entry: HostEntry, spill: bool) -> None:
        """Remove a ready, unpinned entry. ``spill``: its slot stays taken until ``spilled``
        (its bytes are being written to disk); else the slot is free at once."""
        if entry.pins:
            raise ValueError(f"host slot {entry.slot} is pinned {entry.pins} times; it cannot be evicted")
        del self.entries[entry.block_hash]
        if spill:
            self._spilling.add(entry.slot)
        else:
            self._free.append(entry.slot)

    def spilled(self, slot: int) -> None:
        self._spilling.remove(slot)
        self._free.append(slot)

    def clear(self) -> list[HostEntry]:
        """Forget every ready, unpinned entry (their slots become free); returns them."""
        gone = [e for e in self.entries.values() if not e.pins]
        for e in gone:
            self.evict(e, spill=False)
        return gone
