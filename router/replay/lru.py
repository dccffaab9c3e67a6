"""A prefix cache of whole blocks with LRU eviction: the simulated prefill node's cache (with its
host and disk tiers, ``TieredCache``), and the approximate per-node trees that SGLang's and
llm-d's routers keep of what they routed where."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kv_index.nodes import PrefixMatch
from kv_index.schema import TIER_DEVICE, TIER_DISK, TIER_HOST


class LruCache:
    """Blocks by chained hash, least recently used first. A request touches its blocks last to
    first, so a chain's head is the most recently used and its tail is evicted first (what a
    block pool freeing a sequence's blocks in reverse order does, and what a radix tree that
    evicts leaves does). ``capacity`` None: never evicts by itself (``evict_to`` does)."""

    def __init__(self, capacity_blocks: int | None) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: int) -> bool:
        return h in self._blocks

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` held."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Touch/insert ``hashes``; returns (newly stored, evicted)."""
        stored = []
        keep = hashes if self.capacity is None else hashes[: self.capacity]
        for h in reversed(keep):
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = None
                stored.append(h)
        evicted = self.evict_to(self.capacity) if self.capacity is not None else []
        stored_set, evicted_set = set(stored), set(evicted)
        return [h for h in stored if h not in evicted_set], [h for h in evicted if h not in stored_set]

    def evict_to(self, blocks: int) -> list[int]:
        """Evict least recently used blocks until at most ``blocks`` remain; returns them."""
        evicted = []
        while len(self._blocks) > blocks:
            h, _ = self._blocks.popitem(last=False)
            evicted.append(h)
        return evicted

    @property
    def usage(self) -> float:
        return len(self._blocks) / self.capacity if self.capacity else 1.0

    def discard(self, h: int) -> bool:
        """Drop ``h`` if held; True if it was."""
        return self._blocks.pop(h, 0) is None

    def push(self, hashes: Sequence[int]) -> list[int]:
        """Add ``hashes`` as the most recently used, in the given order (the last is the most
        recent), then evict down to capacity; returns the evicted blocks, oldest first."""
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        return self.evict_to(self.capacity) if self.capacity is not None else []


TIERS = (TIER_DEVICE, TIER_HOST, TIER_DISK)


class TieredCache:
    """A node's blocks in three LRU tiers, device, host memory and disk (capacities in blocks; 0:
    the node has no such tier). Each block sits in exactly one tier: a block evicted from the
    device moves to host memory, from there to disk, and from disk it is gone (demotion, the
    least recently used first); a request touches its blocks back into the device, whichever
    tier they were in (onboarding). So the device holds the most recently used blocks, and a
    chain's head (touched last) stays in a faster tier than its tail, the order
    ``router.placement.tier_tokens`` assumes::

        insert([a, b, c]) on a full device:   device [.. a b c]  ->  LRU evicted to host
                                              host   [.. x y]    ->  LRU evicted to disk
                                              disk   [.. z]      ->  LRU dropped
    """

    def __init__(self, device_blocks: int, host_blocks: int = 0, disk_blocks: int = 0) -> None:
        self.levels = (LruCache(device_blocks), LruCache(host_blocks), LruCache(disk_blocks))

    @property
    def capacity(self) -> int:
        """The device tier's capacity: what a node reports as its pool."""
        return self.levels[0].capacity

    def __len__(self) -> int:
        return sum(len(lvl) for lvl in self.levels)

    def tier_of(self, h: int) -> int | None:
        for tier, lvl in zip(TIERS, self.levels):
            if h in lvl:
                return tier
        return None

    def match(self, hashes: Sequence[int]) -> PrefixMatch:
        """Leading blocks of ``hashes`` held in any tier, and how many of them in host / disk."""
        count = [0, 0, 0]
        for h in hashes:
            tier = self.tier_of(h)
            if tier is None:
                break
            count[tier] += 1
        return PrefixMatch(sum(count), count[TIER_HOST], count[TIER_DISK])

    def insert(self, hashes: Sequence[int]) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """Touch/insert ``hashes`` into the device tier, demoting what that evicts. Returns the
        net change as block events per tier: (stored, removed), each tier -> hashes (tiers
        without a change absent), what a node publishes to the index."""
        before: dict[int, int | None] = {}  # block -> its tier before this call
        keep = hashes[: self.capacity]
        for h in keep:
            before.setdefault(h, self.tier_of(h))
            for lvl in self.levels[1:]:
                lvl.discard(h)
        _, evicted = self.levels[0].insert(keep)
        for tier, lvl in zip(TIERS[1:], self.levels[1:]):
            for h in evicted:
                before.setdefault(h, tier - 1)
            evicted = lvl.push(evicted)
        for h in evicted:
            before.setdefault(h, TIERS[-1])
        stored: dict[int, list[int]] = {}
        removed: dict[int, list[int]] = {}
        for h, was in before.items():
            now = self.tier_of(h)
            if was != now:
                if was is not None:
                    removed.setdefault(was, []).append(h)
                if now is not None:
                    stored.setdefault(now, []).append(h)
        return stored, removed
