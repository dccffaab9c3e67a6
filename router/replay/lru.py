"""A prefix cache of whole blocks with LRU eviction: the simulated prefill node's cache, and the
approximate per-node trees that SGLang's and llm-d's routers keep of what they routed where."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


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
