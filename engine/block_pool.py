"""The pool of physical KV blocks: reference counts, an LRU free queue and the prefix cache.

Plain bookkeeping on block ids (no torch); the model runner owns the tensors the ids index.

Every block is in exactly one of two states::

    ref_cnt > 0   held by one or more block tables          (not in the free queue)
    ref_cnt == 0  in the free queue, oldest-freed at the head

A block may also carry a hash (it is in ``cached``) in either state. A cached block with
``ref_cnt == 0`` is *evictable*: it still holds valid KV that a prefix hit can revive with
``touch``, until ``allocate`` pops it off the head of the free queue and reuses it::

    free queue:  head -> [7] [3]* [5]* [2] -> tail        (* = cached)
                 allocate() takes from the head, free() appends at the tail

Callers free a sequence's blocks tail first, so its last blocks are evicted before its first
ones: a shared prompt head is what later requests are most likely to hit.

Events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, the index's vocabulary from
kv_index/events.py) describe every change to ``cached`` so that a node can mirror it into the
router's global index. The tiers below the pool (engine/kv_tiers/) append theirs to the same
list (``emit``), so one batch keeps every tier's changes in order; ``on_cached`` tells them of
each newly cached block (a copy for the host tier starts there).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tokens.block_hash import BlockHash


@dataclass(slots=True, eq=False)  # identity equality: two blocks are never "the same" by value
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Kept to verify a hash hit before reuse: a hash is 64 bits and only a hint.
    token_ids: tuple[int, ...] | None = None


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Blocks ``0 .. num_blocks-1`` (id 0 is an ordinary block), all free at start, in id order."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # An OrderedDict keyed by block id is the LRU queue: O(1) append at the tail, pop at the
        # head, and removal from the middle when a prefix hit revives an evictable block.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVEvent] = []
        # Hears of every block cache_full_block registers, with its parent hash (the tiers).
        self.on_cached: Callable[[KVBlock, BlockHash | None], None] | None = None
        # Prefix-cache counters, in tokens.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- state ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out: never used, freed, and evictable cached ones."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one sequence."""
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be allocated) first. For tests and debugging."""
        return list(self._free)

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_query_tokens += num_query_tokens
        self.prefix_hit_tokens += num_hit_tokens

    # ---- prefix cache --------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The block cached under ``block_hash`` if its stored tokens equal ``token_ids``.

        Takes no reference. A hash match with different tokens (a collision, or a stale entry
        registered with the wrong tokens) is a miss.
        """
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_full_block(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent_hash: BlockHash | None,
    ) -> None:
        """Register a block whose KV for ``token_ids`` is computed, and emit ``BlockStored``.

        If another block already holds ``block_hash`` the cache keeps that one and this block
        stays uncached (two copies of the same KV are fine; two owners of one hash are not).
        """
        if not self.enable_prefix_caching:
            return
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(
                    f"block {block.block_id} is cached as {block.block_hash:#x}, "
                    f"not {block_hash:#x}: its KV would be overwritten"
                )
            return
        if block_hash in self.cached:
            return
        tokens = tuple(token_ids)
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks are cached: {len(tokens)} != {self.block_size} tokens")
        block.block_hash = block_hash
        block.token_ids = tokens
        self.cached[block_hash] = block
        self._events.append(BlockStored((block_hash,), parent_hash, (tokens,)))
        if self.on_cached is not None:
            self.on_cached(block, parent_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is referenced."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
            block.token_ids = None
        self.cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def emit(self, event: KVEvent) -> None:
        """Append another tier's event to this batch, in order with the pool's own."""
        self._events.append(event)

    # ---- references ----------------------------------------------------------------------

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block; a block at 0 leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        """Pop ``n`` blocks off the LRU head, each with ``ref_cnt == 1`` and no hash.

        A popped block that was cached is evicted (one ``BlockRemoved`` for the whole call).
        Raises ``NoFreeBlocksError`` and changes nothing when fewer than ``n`` are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        out: list[KVBlock] = []
        evicted: list[BlockHash] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self.cached[block.block_hash]
                block.block_hash = None
                block.token_ids = None
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue's tail in
        the order given (so pass a sequence's blocks tail first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
