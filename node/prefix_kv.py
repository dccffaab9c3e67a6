"""A prefix's KV blocks in the engine's pool, for the two ends of a prefix fetch: the holder
pins the blocks it sends (``pin_prefix``), the fetching node reserves blocks to receive into
(``reserve_prefix``) and registers them as cached once they landed (``register_prefix``).

Each function runs on the engine thread (``AsyncEngine.run``): they touch the block pool the
engine steps over. Pins and reservations are block tables of their own under an id that no
request uses, so the pool's reference counts keep the blocks from being evicted or written
until ``LLMEngine.release_kv(id)`` gives them back::

    holder:    pin_prefix(id)      blocks [0, m) of the chain, verified, ref +1 (host and disk
                                   blocks copied back to the device first) --> pushed
               unpin_prefix(id)    unpinned (they stay cached)
    fetcher:   reserve_prefix(id)  its own leading hit [0, held) pinned, fresh blocks [held, n)
               ... the holder pushes into [held, held + m) ...
               register_prefix(id, held + m)  hashed from this node's own tokens: cached
               prefill             its prefix lookup hits [0, held + m)
               release_kv(id)      after the prefill (they stay cached)

Both ends verify tokens: the holder looks a block up by its hash and compares its stored tokens
with the ones asked for (``LLMEngine.export_prefix``, engine/engine_tiers.py); the fetching node's blocks are hashed
from its own prompt when registered, and the receiver refused any transfer whose header named
other hashes (kv_transfer/validate.py).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

from engine.engine import LLMEngine
from engine.kv_cache_manager import PrefixHit
from engine.sequence import seq_id_of
from kv_index.schema import TIER_DISK, TIER_HOST


def leading_cached(eng: LLMEngine, hashes: Sequence[int], tokens: Sequence[int]) -> list:
    """The device pool's blocks of the longest run of ``hashes`` it caches, tokens verified; no
    reference taken (nor a prefix-cache query counted: this is not a request's lookup). The
    fetching node's own blocks in its host or disk tier are not counted: it fetches them again
    rather than onboarding them first (the holder's push is what the router priced)."""
    bs = eng.block_size
    blocks = []
    for i, h in enumerate(hashes):
        block = eng.kv.pool.get_cached_block(h, tokens[i * bs : (i + 1) * bs])
        if block is None:
            break
        blocks.append(block)
    return blocks


def _hold(eng: LLMEngine, hold_id: str, hit: list, total_blocks: int) -> list[int] | None:
    """A block table under ``hold_id``: the ``hit`` blocks (referenced) then fresh ones up to
    ``total_blocks``; None when the pool cannot spare the fresh ones."""
    seq = seq_id_of(hold_id, 0)
    if eng.kv.has_seq(seq):
        raise ValueError(f"KV hold {hold_id!r} already exists")
    bs = eng.block_size
    cached = len(hit) * bs
    if not eng.kv.allocate_slots(seq, cached, total_blocks * bs, PrefixHit(hit, cached) if hit else None):
        return None
    return eng.kv.get_block_table(seq)


class Pinned(NamedTuple):
    """What the holder pinned for a push: device block ids of the leading blocks held, and of
    those, how many it brought back from host memory and from disk first, in how long."""

    block_ids: list[int]
    host_blocks: int = 0
    disk_blocks: int = 0
    onboard_s: float = 0.0


def pin_prefix(eng: LLMEngine, pin_id: str, hashes: Sequence[int], tokens: Sequence[int],
               cache_salt: bytes = b"") -> Pinned:
    """Holder: the longest leading run of ``hashes`` (tokens ``tokens``) this engine holds, in
    any tier, in device blocks pinned under ``pin_id`` (``LLMEngine.export_prefix``: host and
    disk blocks are copied back first); release with ``unpin_prefix``."""
    where = eng.held_prefix(hashes, tokens, cache_salt)
    t0 = time.perf_counter()
    table = eng.export_prefix(pin_id, hashes, tokens, cache_salt)
    seconds = time.perf_counter() - t0
    lower = where[: len(table)]
    host, disk = lower.count(TIER_HOST), lower.count(TIER_DISK)
    return Pinned(table, host, disk, seconds if host or disk else 0.0)


def unpin_prefix(eng: LLMEngine, pin_id: str) -> None:
    eng.release_export(pin_id)


def reserve_prefix(eng: LLMEngine, hold_id: str, hashes: Sequence[int],
                   tokens: Sequence[int]) -> tuple[int, list[int]] | None:
    """Fetching node: blocks for the ``len(hashes)`` leading full blocks of a prompt (``tokens``
    their tokens) under ``hold_id`` -> (blocks already cached here, the fresh block ids for the
    rest), or None when the pool cannot take them now. All cached: (n, []), nothing held."""
    hit = leading_cached(eng, hashes, tokens)
    if len(hit) >= len(hashes):
        return len(hashes), []
    table = _hold(eng, hold_id, hit, len(hashes))
    if table is None:
        return None
    return len(hit), table[len(hit):]


def register_prefix(eng: LLMEngine, hold_id: str, tokens: Sequence[int], num_blocks: int,
                    cache_salt: bytes = b"") -> None:
    """Fetching node: blocks [0, num_blocks) of ``hold_id`` hold their final KV now; cache them
    (hashed from ``tokens``, the prompt's own, under the request's ``cache_salt``) so the
    prefill's lookup hits them."""
    eng.kv.cache_computed_blocks(seq_id_of(hold_id, 0), list(tokens), num_blocks * eng.block_size, cache_salt)
