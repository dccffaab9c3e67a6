"""Block events: how a node's prefix cache tells the index what it holds.

The engine's block pool emits them (engine/block_pool.py) for every change to its cache; the
node folds each batch (``fold_kv_events``) and publishes it with one script call
(publisher.py). Plain data, so the engine, the nodes and the trace simulator share them.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokens.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None  # hash of the block before block_hashes[0]; None: chain start
    token_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def fold_kv_events(events: Iterable[KVEvent]) -> tuple[list[int], list[int], bool]:
    """Net effect of block events in order -> (stored, removed, cleared).

    ``NodePublisher.publish`` applies cleared, then removed, then stored; folding first makes
    that order right whatever the batch held (a block stored then evicted in the same batch
    ends up removed, not stored).
    """
    state: dict[int, bool] = {}  # hash -> stored (True) / removed (False); insertion order kept
    cleared = False
    for ev in events:
        if isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                state.pop(h, None)
                state[h] = True
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                state.pop(h, None)
                state[h] = False
        elif isinstance(ev, AllBlocksCleared):
            cleared = True
            state.clear()
        else:
            raise TypeError(f"unknown KV event {type(ev).__name__}")
    stored = [h for h, s in state.items() if s]
    removed = [h for h, s in state.items() if not s]
    return stored, removed, cleared
