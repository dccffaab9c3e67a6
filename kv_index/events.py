"""Block events: how a node's prefix cache tells the index what it holds.

The engine's block pool emits them (engine/block_pool.py) for every change to its cache, and
its lower tiers (engine/kv_tiers/) for every block that enters or leaves host memory or disk;
the node folds each batch (``fold_kv_events``) and publishes it with one script call
(publisher.py). Plain data, so the engine, the nodes and the trace simulator share them.

A block may sit in several tiers of one node at once (the host tier keeps a copy of a device
block), so an event names its ``tier`` and the fold keeps one state per (hash, tier): a block
written to the host tier and then evicted from the device pool in the same batch ends up
stored in the host tier and removed from the device tier, not merely "removed".
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kv_index.schema import TIER_DEVICE, TIER_DISK, TIER_HOST  # noqa: F401 (re-exported: engine/ imports only this module)
from tokens.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None  # hash of the block before block_hashes[0]; None: chain start
    token_ids: tuple[tuple[int, ...], ...]
    tier: int = TIER_DEVICE  # kv_index.schema TIER_DEVICE / TIER_HOST / TIER_DISK


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    tier: int = TIER_DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every tier of the node forgot every block."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def fold_kv_events_by_tier(
    events: Iterable[KVEvent],
) -> tuple[dict[int, list[int]], dict[int, list[int]], bool]:
    """Net effect of block events in order, per (hash, tier) -> (stored, removed, cleared),
    ``stored`` and ``removed`` mapping a tier to its hashes (tiers without any are absent).

    ``NodePublisher.publish`` applies cleared, then removed, then stored; folding first makes
    that order right whatever the batch held (a block stored then evicted in the same batch
    ends up removed, not stored).
    """
    # (hash, tier) -> stored (True) / removed (False); insertion order kept
    state: dict[tuple[int, int], bool] = {}
    cleared = False
    for ev in events:
        if isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                state.pop((h, ev.tier), None)
                state[(h, ev.tier)] = True
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                state.pop((h, ev.tier), None)
                state[(h, ev.tier)] = False
        elif isinstance(ev, AllBlocksCleared):
            cleared = True
            state.clear()
        else:
            raise TypeError(f"unknown KV event {type(ev).__name__}")
    stored: dict[int, list[int]] = {}
    removed: dict[int, list[int]] = {}
    for (h, tier), s in state.items():
        (stored if s else removed).setdefault(tier, []).append(h)
    return stored, removed, cleared


def fold_kv_events(events: Iterable[KVEvent], tier: int = TIER_DEVICE) -> tuple[list[int], list[int], bool]:
    """``fold_kv_events_by_tier`` seen from one tier (the device pool unless told): what an
    index that keeps a single tier per block applies."""
    stored, removed, cleared = fold_kv_events_by_tier(events)
    return stored.get(tier, []), removed.get(tier, []), cleared
