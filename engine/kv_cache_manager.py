"""The scheduler's only view of KV memory: one block table per sequence over a ``BlockPool``.

Invariant (holds between any two calls):

* a sequence's block table has ``ceil(allocated_tokens / block_size)`` blocks, where
  ``allocated_tokens`` is the largest ``total_tokens`` given to ``allocate_slots`` since the
  sequence started or was last truncated (then ``num_tokens`` of that ``truncate``);
* every block in any table has ``ref_cnt`` equal to the number of tables holding it (so >= 1),
  plus one while the host tier copies it out (engine/kv_tiers/: at most ``max_inflight``);
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

A request's cache salt (``salt``: ``Sequence.cache_salt``) seeds the root of its chain
(tokens/block_hash.py): lookups, registrations and exports under one salt never meet blocks of
another, so tenants share no block and cannot probe each other's prompts. b"": no salt, the
hashes every request had before salts.

With tiers below the pool (``tiers``, engine/kv_tiers/), a prefix lookup continues past the
device hits into the host and disk tiers; ``allocate_slots`` gives those blocks fresh device
blocks and queues ``(host slot, block)`` swap-ins, which the model runner copies in before the
step that reads them (``take_swap_ins`` / ``finish_swap_ins``, like ``take_copies``)::

    positions   0 1 2 3 | 4 5 6 7 | 8 9 a b | c d .
                device  | host    | disk    | new        lookup_prefix: 3 hit blocks
    table       [ b3    ,  b6     ,  b1     ,  b2  ]     b6, b1 fresh; swap-ins (s4, b6), (s9, b1)
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from engine.block_pool import BlockPool, KVBlock, KVEvent
from kv_index.events import TIER_DEVICE, TIER_DISK, TIER_HOST
from tokens.block_hash import BlockHash, chain_root, hash_block_tokens

if TYPE_CHECKING:
    from engine.kv_tiers.tiers import KVTiers, TierHit


class PrefixHit(NamedTuple):
    blocks: list[KVBlock]  # verified cached full device blocks, prompt head first; no references taken
    num_tokens: int  # (len(blocks) + len(lower)) * block_size
    # Blocks after ``blocks`` found in the host or disk tier (now in host slots), in order.
    lower: tuple["TierHit", ...] = ()


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
        tiers: KVTiers | None = None,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_key = extra_key
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.tiers = tiers if enable_prefix_caching else None
        if self.tiers is not None:
            self.tiers.bind(self.pool)
        self._tables: dict[str, list[KVBlock]] = {}
        # Chained hashes of each sequence's leading full blocks whose KV is computed: how far
        # cache_computed_blocks got, and the parent of the next block to hash.
        self._hashes: dict[str, list[BlockHash]] = {}
        self._copies: list[tuple[int, int]] = []
        self._swap_ins: list[tuple[int, int]] = []  # (host slot, device block), not yet taken
        self._swap_pins: list = []  # the host entries those read, pinned until finish_swap_ins
        self._taken_pins: list = []
        self.device_hit_blocks = 0  # device blocks reused by allocations (the device tier's hits)

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

    def take_swap_ins(self) -> list[tuple[int, int]]:
        """Pending swap-ins ``(host slot, device block id)``: the model runner copies them in
        before the step that reads them, then the caller calls ``finish_swap_ins``."""
        swaps, self._swap_ins = self._swap_ins, []
        self._taken_pins.extend(self._swap_pins)
        self._swap_pins = []
        return swaps

    def finish_swap_ins(self) -> None:
        """The taken swap-ins are in the device pool: their host slots may be evicted again."""
        if self.tiers is not None:
            self.tiers.unpin(self._taken_pins)
        self._taken_pins = []

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, in every tier; refused (False) while any device block is
        referenced (host-tier copies in flight count)."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.tiers is not None:
            self.tiers.clear()
        return True

    # ---- prefix cache --------------------------------------------------------------------

    def lookup_prefix(self, token_ids: Sequence[int], salt: bytes = b"") -> PrefixHit:
        """Longest chain of verified cached full blocks at the head of ``token_ids``, hashed
        under ``salt``.

        Capped so at least one prompt token is left to compute (its logits start decoding)::

            block_size 4, 8 prompt tokens:  | a b c d | e f g h |
            at most (8 - 1) // 4 = 1 block:  | hit     | compute |

        Takes no references: use the hit in ``allocate_slots`` before any other allocation
        can evict its blocks. Each call counts as one prefix-cache query.
        """
        hit = self._lookup(token_ids, (len(token_ids) - 1) // self.block_size, salt)
        self.pool.record_prefix_query(len(token_ids), hit.num_tokens)
        return hit

    def _lookup(self, token_ids: Sequence[int], max_blocks: int, salt: bytes = b"") -> PrefixHit:
        """Device hits, then (with tiers) host and disk hits, at most ``max_blocks`` in all."""
        if not self.enable_prefix_caching:
            return _NO_HIT
        bs = self.block_size
        blocks: list[KVBlock] = []
        parent: BlockHash | None = chain_root(self.extra_key, salt)
        # Hash lazily: a miss on block i makes hashing blocks i+1.. pointless.
        for i in range(max_blocks):
            chunk = token_ids[i * bs : (i + 1) * bs]
            h = hash_block_tokens(parent, chunk, self.extra_key)
            block = self.pool.get_cached_block(h, chunk)
            if block is None:
                break
            blocks.append(block)
            parent = h
        lower: tuple = ()
        if self.tiers is not None and len(blocks) < max_blocks:
            lower = tuple(self.tiers.lookup(parent, token_ids, len(blocks), max_blocks, bs, self.extra_key))
        return PrefixHit(blocks, (len(blocks) + len(lower)) * bs, lower)

    def cache_computed_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                              salt: bytes = b"") -> None:
        """Register every block now entirely filled by ``token_ids[:num_computed_tokens]``,
        chained from the root of ``salt`` (the sequence's; it matters only for the first block).

        Only ever call this with tokens whose KV is computed and final (speculative tokens
        only after verification): a registered block is served to other requests as is.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables[seq_id]
        hashes = self._hashes[seq_id]
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(table))
        root = chain_root(self.extra_key, salt)
        for i in range(len(hashes), num_full):
            # The pool's parent stays None for a chain's first block (events: "chain start").
            parent = hashes[-1] if hashes else None
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            block_hash = hash_block_tokens(root if parent is None else parent, chunk, self.extra_key)
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
            if hit is not None and (hit.blocks or hit.lower):
                self._check_hit(hit)
                to_touch = table = hit.blocks
        elif hit is not None and (hit.blocks or hit.lower):
            raise ValueError(f"{seq_id!r} already has blocks; a prefix hit only applies to its first allocation")
        bs = self.block_size
        need = _cdiv(total_tokens, bs)
        # Existing blocks that the new tokens [num_computed_tokens, total_tokens) write into.
        first, last = num_computed_tokens // bs, min(len(table), need)
        cow = [i for i in range(first, last) if table[i].ref_cnt > 1 or table[i].block_hash is not None]
        return to_touch, table, cow, max(0, need - len(table))

    def _check_hit(self, hit: PrefixHit) -> None:
        stale = [b for b in hit.blocks if b.block_hash is None or self.pool.cached.get(b.block_hash) is not b]
        if stale or (hit.lower and not self.tiers.check(hit.lower)):
            raise ValueError(
                "stale prefix hit: a block was evicted since lookup_prefix; "
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
        plan = self._plan(seq_id, num_computed_tokens, total_tokens, hit)
        return self._fits(plan, reserve_blocks) or self._fits_after_flush(seq_id, num_computed_tokens, total_tokens,
                                                                           hit, reserve_blocks) is not None

    def _fits(self, plan, reserve_blocks: int) -> bool:
        return self.pool.num_free_blocks - _needed(*plan) >= reserve_blocks

    def _fits_after_flush(self, seq_id, num_computed_tokens, total_tokens, hit, reserve_blocks):
        """The plan once the host tier's copies in flight released their device blocks, if it
        fits then (None: it does not, or no block was held by a copy)."""
        if self.tiers is None or not self.tiers.device_pins:
            return None
        self.tiers.flush()
        plan = self._plan(seq_id, num_computed_tokens, total_tokens, hit)
        return plan if self._fits(plan, reserve_blocks) else None

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

        A hit's ``lower`` blocks (host, disk) start the table after its device blocks, in fresh
        blocks whose swap-ins wait in ``take_swap_ins``; their host slots stay pinned until
        ``finish_swap_ins``.
        """
        plan = self._plan(seq_id, num_computed_tokens, total_tokens, hit)
        if not self._fits(plan, reserve_blocks):
            plan = self._fits_after_flush(seq_id, num_computed_tokens, total_tokens, hit, reserve_blocks)
            if plan is None:
                return False
        to_touch, table, cow, grow = plan
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
        if to_touch or (hit is not None and hit.lower):
            self.device_hit_blocks += len(to_touch)
            if self.tiers is not None:
                # A block hot in the pool is hot below it too: its copies must not be the
                # lower tiers' first victims, or they are gone when the pool evicts it.
                self.tiers.touch(b.block_hash for b in to_touch)
            self._swap_in(hit.lower, table[len(to_touch):len(to_touch) + len(hit.lower)])
        hashes = self._hashes.setdefault(seq_id, [b.block_hash for b in to_touch])
        # Blocks being rewritten are no longer the computed blocks that were hashed.
        del hashes[num_computed_tokens // self.block_size :]
        return True

    def _swap_in(self, lower, blocks: list[KVBlock]) -> None:
        if not lower:
            return
        self.tiers.pin(lower)
        self.tiers.count_onboard(lower)
        self._swap_pins.extend(h.entry for h in lower)
        self._swap_ins.extend((h.entry.slot, b.block_id) for h, b in zip(lower, blocks))

    # ---- export (a peer fetches a prefix) ------------------------------------------------

    def held_tiers(self, token_ids: Sequence[int], block_hashes: Sequence[int] | None = None,
                   salt: bytes = b"") -> list[int]:
        """The tier holding each leading full block of ``token_ids`` (device first, then host,
        then disk; chained under ``salt``), up to the first held nowhere, or whose chained hash
        differs from ``block_hashes[i]`` when given. Reads only: no LRU change, no disk read."""
        if not self.enable_prefix_caching:
            return []
        bs, tiers = self.block_size, self.tiers
        n = len(token_ids) // bs if block_hashes is None else min(len(block_hashes), len(token_ids) // bs)
        out: list[int] = []
        parent: BlockHash | None = chain_root(self.extra_key, salt)
        for i in range(n):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block_tokens(parent, chunk, self.extra_key)
            if block_hashes is not None and block_hashes[i] != h:
                break
            if self.pool.get_cached_block(h, chunk) is not None:
                out.append(TIER_DEVICE)
            elif tiers is not None and tiers.host.get(h, chunk) is not None:
                out.append(TIER_HOST)
            elif tiers is not None and tiers.disk is not None and tiers.disk.get(h, chunk) is not None:
                out.append(TIER_DISK)
            else:
                break
            parent = h
        return out

    def pin_prefix(self, pin_id: str, token_ids: Sequence[int], max_blocks: int, salt: bytes = b"") -> PrefixHit:
        """Hold the leading cached blocks of ``token_ids`` (at most ``max_blocks``, every tier)
        in the device pool under the pseudo-sequence ``pin_id``, for a send: device hits take a
        reference; host and disk hits get fresh device blocks and swap-ins (apply them with
        ``take_swap_ins`` / ``finish_swap_ins`` before reading the blocks). Release with
        ``free(pin_id)``. When the pool cannot take the lower hits, only the device ones are held.
        Returns the hit held (its ``num_tokens`` is what ``get_block_table(pin_id)`` covers).
        ``salt``: the chain's cache salt, as in ``lookup_prefix``."""
        if self.has_seq(pin_id):
            raise ValueError(f"{pin_id!r} already exists")
        max_blocks = min(max_blocks, len(token_ids) // self.block_size)
        hit = self._lookup(token_ids, max_blocks, salt)
        for h in (hit, PrefixHit(hit.blocks, len(hit.blocks) * self.block_size)):
            if h.num_tokens and self.allocate_slots(pin_id, h.num_tokens, h.num_tokens, h):
                return h
        return _NO_HIT

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
