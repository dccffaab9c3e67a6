"""The scheduler's only view of KV memory: one block table per sequence over a ``BlockPool``.

Invariant (holds between any two calls):

* a sequence's block table has ``ceil(allocated_tokens / block_size)`` blocks, where
  ``allocated_tokens`` is the largest ``total_tokens`` given to ``allocate_slots`` since the
  sequence started or was last truncated (then ``num_tokens`` of that ``truncate``);
* every block in any table has ``ref_cnt`` equal to the number of tables holding it (so >= 1);
* the pool's free queue holds exactly the blocks with ``ref_cnt == 0``.

A block that is shared (``ref_cnt > 1``) or cached (it has a hash) is never written again:
a write that would land in one copies it first (copy-on-write), so forks and the prefix cache
can never see each other's new tokens.

One sequence, block_size 4, as the scheduler moves it along::

    positions   0 1 2 3 | 4 5 6 7 | 8 9 . .
                cached  | computed| new      <- allocate_slots(seq, 8, 10)
                (hit)   |         |          writes positions [8, 10)
    table       [ b3    ,  b0     ,  b5  ]   3 blocks = ceil(10 / 4)

    cache_computed_blocks(seq, tokens, 10) then hashes block 1 (block 0 came hashed
    from the hit; block 2 is partial and waits until positions 8..11 are all computed).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from engine.block_pool import BlockPool, KVBlock, KVEvent
from tokens.block_hash import BlockHash, hash_block_tokens


class PrefixHit(NamedTuple):
    blocks: list[KVBlock]  # verified cached full blocks, prompt head first; no references taken
    num_tokens: int  # len(blocks) * block_size


_NO_HIT = PrefixHit([], 0)


def _needed(to_touch: list[KVBlock], table, cow: list[int], grow: int) -> int:
    """Free-queue blocks a plan takes: revived hit blocks (ref 0), copies, growth."""
    return sum(1 for b in to_touch if b.ref_cnt == 0) + len(cow) + grow


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        extra_key: bytes = b"",
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_key = extra_key
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self._tables: dict[str, list[KVBlock]] = {}
        # Chained hashes of each sequence's leading full blocks whose KV is computed: how far
        # cache_computed_blocks got, and the parent of the next block to hash.
        self._hashes: dict[str, list[BlockHash]] = {}
        self._copies: list[tuple[int, int]] = []

    # ---- state ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def has_seq(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def get_block_table(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self._tables[seq_id]]

    def take_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write copies ``(src_block_id, dst_block_id)``, in order. The model
        runner must apply them before the step that writes the new tokens."""
        copies, self._copies = self._copies, []
        return copies

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    # ---- prefix cache --------------------------------------------------------------------

    def lookup_prefix(self, token_ids: Sequence[int]) -> PrefixHit:
        """Longest chain of verified cached full blocks at the head of ``token_ids``.

        Capped so at least one prompt token is left to compute (its logits start decoding)::

            block_size 4, 8 prompt tokens:  | a b c d | e f g h |
            at most (8 - 1) // 4 = 1 block:  | hit     | compute |

        Takes no references: use the hit in ``allocate_slots`` before any other allocation
        can evict its blocks. Each call counts as one prefix-cache query.
        """
        hit = self._lookup(token_ids)
        self.pool.record_prefix_query(len(token_ids), hit.num_tokens)
        return hit

    def _lookup(self, token_ids: Sequence[int]) -> PrefixHit:
        if not self.enable_prefix_caching:
            return _NO_HIT
        bs = self.block_size
        blocks: list[KVBlock] = []
        parent: BlockHash | None = None
        # Hash lazily: a miss on block i makes hashing blocks i+1.. pointless.
        for i in range((len(token_ids) - 1) // bs):
            chunk = token_ids[i * bs : (i + 1) * bs]
            parent = hash_block_tokens(parent, chunk, self.extra_key)
            block = self.pool.get_cached_block(parent, chunk)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(blocks, len(blocks) * bs)

    def cache_computed_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register every block now entirely filled by ``token_ids[:num_computed_tokens]``.

        Only ever call this with tokens whose KV is computed and final (speculative tokens
        only after verification): a registered block is served to other requests as is.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables[seq_id]
        hashes = self._hashes[seq_id]
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(table))
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            block_hash = hash_block_tokens(parent, chunk, self.extra_key)
            self.pool.cache_full_block(table[i], block_hash, chunk, parent)
            hashes.append(block_hash)

    # ---- allocation ----------------------------------------------------------------------

    def _plan(
        self, seq_id: str, num_computed_tokens: int, total_tokens: int, hit: PrefixHit | None
    ) -> tuple[list[KVBlock], list[KVBlock], list[int], int]:
        """What ``allocate_slots`` would do, changing nothing.

        Returns (blocks to touch, the table they start, indices to copy on write, number of
        fresh blocks to take from the pool for growth).
        """
        if not 0 <= num_computed_tokens <= total_tokens:
            raise ValueError(f"need 0 <= num_computed_tokens ({num_computed_tokens}) <= total_tokens ({total_tokens})")
        table = self._tables.get(seq_id)
        to_touch: list[KVBlock] = []
        if table is None:
            table = []
            if hit is not None and hit.blocks:
                self._check_hit(hit)
                to_touch = table = hit.blocks
        elif hit is not None and hit.blocks:
            raise ValueError(f"{seq_id!r} already has blocks; a prefix hit only applies to its first allocation")
        bs = self.block_size
        need = _cdiv(total_tokens, bs)
        # Existing blocks that the new tokens [num_computed_tokens, total_tokens) write into.
        first, last = num_computed_tokens // bs, min(len(table), need)
        cow = [i for i in range(first, last) if table[i].ref_cnt > 1 or table[i].block_hash is not None]
        return to_touch, table, cow, max(0, need - len(table))

    def _check_hit(self, hit: PrefixHit) -> None:
        for block in hit.blocks:
            if block.block_hash is None or self.pool.cached.get(block.block_hash) is not block:
                raise ValueError(
                    f"stale prefix hit: block {block.block_id} was evicted since lookup_prefix; "
                    "look up again right before allocate_slots"
                )

    def num_new_blocks(
        self, seq_id: str, num_computed_tokens: int, total_tokens: int, hit: PrefixHit | None = None
    ) -> int:
        """Blocks ``allocate_slots`` would take out of the free queue: fresh ones for growth,
        copy-on-write copies, and hit blocks that are evictable (ref 0) right now."""
        return _needed(*self._plan(seq_id, num_computed_tokens, total_tokens, hit))

    def can_allocate(
        self,
        seq_id: str,
        num_computed_tokens: int,
        total_tokens: int,
        hit: PrefixHit | None = None,
        reserve_blocks: int = 0,
    ) -> bool:
        """True when the allocation fits and still leaves ``reserve_blocks`` free (the
        watermark a scheduler keeps for running sequences when admitting a new one)."""
        needed = self.num_new_blocks(seq_id, num_computed_tokens, total_tokens, hit)
        return self.pool.num_free_blocks - needed >= reserve_blocks

    def allocate_slots(
        self,
        seq_id: str,
        num_computed_tokens: int,
        total_tokens: int,
        hit: PrefixHit | None = None,
        reserve_blocks: int = 0,
    ) -> bool:
        """Make ``seq_id``'s table cover positions ``[0, total_tokens)`` so the new tokens can be
        written at ``[num_computed_tokens, total_tokens)``::

            positions  0 ........ num_computed ........ total_tokens
                       | KV in cache |  new tokens (written this step) |
                       ^ hit blocks start the table on a sequence's first call

        Existing blocks in the write range that are shared (after ``fork``) or cached are
        replaced by fresh copies; the ``(src, dst)`` pairs wait in ``take_copies``.
        Returns False and changes nothing when the pool has too few free blocks, or would keep
        fewer than ``reserve_blocks`` free (the scheduler's watermark for new requests).
        """
        plan = self._plan(seq_id, num_computed_tokens, total_tokens, hit)
        to_touch, table, cow, grow = plan
        if self.pool.num_free_blocks - _needed(*plan) < reserve_blocks:
            return False
        # Touch the hit first: allocate() pops the free queue's head, which may be a hit block.
        self.pool.touch(to_touch)
        table = list(table)
        fresh = self.pool.allocate(len(cow) + grow)
        replaced: list[KVBlock] = []
        for i, dst in zip(cow, fresh):
            self._copies.append((table[i].block_id, dst.block_id))
            replaced.append(table[i])
            table[i] = dst
        table.extend(fresh[len(cow) :])
        # Dropped only now, so a source cannot be handed out again as its own copy.
        self.pool.free(reversed(replaced))
        self._tables[seq_id] = table
        hashes = self._hashes.setdefault(seq_id, [b.block_hash for b in to_touch])
        # Blocks being rewritten are no longer the computed blocks that were hashed.
        del hashes[num_computed_tokens // self.block_size :]
        return True

    # ---- sharing and release -------------------------------------------------------------

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent, the partial last one too; whichever
        writes into a shared block first gets a copy (see ``allocate_slots``)."""
        if child_id in self._tables:
            raise ValueError(f"{child_id!r} already exists")
        table = self._tables[parent_id]
        self.pool.touch(table)
        self._tables[child_id] = list(table)
        self._hashes[child_id] = list(self._hashes[parent_id])

    def free(self, seq_id: str) -> None:
        """Release all of a sequence's blocks, tail first (its head stays cached longest).
        Unknown sequences are ignored: aborting a request that never got blocks is fine."""
        table = self._tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        if table is not None:
            self.pool.free(reversed(table))

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Keep positions ``[0, num_tokens)`` (speculative rollback)::

            block_size 4, truncate to 6:  | 0 1 2 3 | 4 5 x x | x x x x |
                                          kept      kept       freed
                                          hashed    (partial: hash progress forgotten)
        """
        table = self._tables[seq_id]
        keep = _cdiv(num_tokens, self.block_size)
        dropped = table[keep:]
        del table[keep:]
        self.pool.free(reversed(dropped))
        del self._hashes[seq_id][num_tokens // self.block_size :]
