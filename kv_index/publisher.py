"""Node side of the index: register, heartbeat load (the lease), publish block events and
step reports.

Events are applied by a server-side script (``schema.APPLY_EVENTS``) that checks the batch's
sequence number against the node's ``seq``: a batch that does not follow the last applied one
(a lost publish, a Redis restart, an expired lease whose entries were pruned) is refused as a
gap, and the node then replaces all its entries with its snapshot (``resync``). Each script
that changes entries also appends its event to the index's event stream, which routers' local
copies follow (kv_index/event_feed.py).

A node's lease is its HASH's ``lease_until`` field, on Redis's clock, set by every heartbeat: when
a node dies readers stop seeing it within ``lease_s``, so it stops receiving work, and the next
``IndexReader.prune_dead`` removes it. No key TTL: see kv_index/schema.py.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import redis

from kv_index.matmul_curve import format_curve
from kv_index.nodes import NodeInfo, StepReport
from kv_index.schema import (
    DEFAULT_NS,
    LOAD_FIELDS,
    MAX_SLOTS,
    STEP_STREAM_MAXLEN,
    TIER_DEVICE,
    drop_node_blocks,
    event_keys,
    node_key,
    nodes_key,
    pack_hashes,
    slots_key,
    steps_key,
    tag,
    tier_bit,
)
from kv_index.scripts import APPLY_EVENTS, LEASE, RESYNC

# Block hashes of one tier (the publisher's), or tier -> hashes.
TierHashes = Iterable[int] | Mapping[int, Iterable[int]]


class IndexFull(RuntimeError):
    """Every one of the namespace's ``MAX_SLOTS`` index slots is held by another node."""


class NodePublisher:
    """Node side: register, heartbeat load (the lease), publish block events and step reports.

    Not thread-safe: one publisher thread per node owns it (``seq`` is its state)."""

    def __init__(self, client: redis.Redis, info: NodeInfo, ns: str = DEFAULT_NS, lease_s: float = 3.0,
                 tier: int = TIER_DEVICE) -> None:
        """``tier``: what plain lists of hashes given to ``publish`` and ``resync`` mean."""
        self.r = client
        self.info = info
        self.ns = ns
        self.lease_ms = int(lease_s * 1000)
        self.tier = tier
        self.seq = 0  # last event batch the index acknowledged
        self._key = node_key(ns, info.node_id)
        self._keys = [self._key, slots_key(ns), *event_keys(ns)]
        self._apply = client.register_script(APPLY_EVENTS)
        self._resync = client.register_script(RESYNC)
        self._lease = client.register_script(LEASE)

    def _identity(self) -> dict:
        i = self.info
        return {"role": i.role, "grpc": i.grpc_address, "fingerprint": i.fingerprint,
                "block_size": i.block_size, "num_blocks": i.num_blocks, "metrics": i.metrics_address,
                "kv_endpoints": ",".join(i.kv_endpoints), "matmul_ms": format_curve(i.matmul_ms)}

    def register(self) -> None:
        """Announce a fresh node: no blocks, sequence 0. A restarted node reuses no state:
        whatever it published before is gone with its pool, so it resyncs to nothing."""
        self.seq = -1
        self.resync(())

    def heartbeat(self, load: Mapping[str, float | int]) -> bool:
        """Refresh the lease and the load figures in one round trip. Returns False when the
        node's index state was lost (its HASH had expired or Redis restarted): the caller then
        resyncs from its snapshot."""
        fields = {k: load[k] for k in LOAD_FIELDS if k in load}
        fields["updated_at"] = time.time()
        # Re-create identity fields too: a heartbeat after a prune re-registers the node.
        return bool(self._renew({**fields, **self._identity()}))

    def _renew(self, fields: Mapping) -> int:
        flat = [x for kv in fields.items() for x in kv]
        return self._lease(keys=[self._key, nodes_key(self.ns)],
                           args=[self.info.node_id, self.lease_ms, *flat])

    def publish(self, stored: TierHashes = (), removed: TierHashes = (), cleared: bool = False) -> bool:
        """Apply one batch of block events (chained hashes) in one round trip, as batch
        ``seq + 1``: ``cleared`` first, then the removals, then the stores. ``stored`` and
        ``removed`` are hashes of this publisher's ``tier``, or tier -> hashes. Returns False
        on a gap (nothing applied): call ``resync``."""
        stored, removed = self._by_tier(stored), self._by_tier(removed)
        if not (stored or removed or cleared):
            return True
        nid = self.info.node_id
        args: list = [tag(self.ns), nid, self.seq + 1, time.time(), "1" if cleared else "0"]
        for op, groups in (("-", removed), ("+", stored)):
            for tier, hashes in groups.items():
                args += [op, tier, pack_hashes(hashes)]
        ok, _ = self._apply(keys=self._keys, args=args)
        if ok:
            self.seq += 1
        return bool(ok)

    def resync(self, held: Iterable[int] | Mapping[int, int]) -> None:
        """Replace every entry of this node with ``held`` (its snapshot: hashes of this
        publisher's ``tier``, or hash -> tier mask, ``schema.tier_bit``), re-registering it if
        it had been pruned; one round trip plus the registry refresh. ``IndexFull`` when the
        namespace's ``MAX_SLOTS`` slots are all taken by other nodes."""
        nid = self.info.node_id
        self._renew({**self._identity(), "updated_at": time.time()})
        seq = self.seq + 1
        masks: dict[int, list[int]] = {}
        if isinstance(held, Mapping):
            for h, mask in held.items():
                if mask:
                    masks.setdefault(mask, []).append(h)
        else:
            masks[tier_bit(self.tier)] = list(held)
        args: list = [tag(self.ns), nid, seq, time.time()]
        for mask, hashes in masks.items():
            if hashes:
                args += [mask, pack_hashes(hashes)]
        try:
            self._resync(keys=self._keys, args=args)
        except redis.ResponseError as e:
            if "index full" in str(e):
                raise IndexFull(f"node {nid} refused by the index: all {MAX_SLOTS} slots of namespace "
                                f"{self.ns!r} are held by other nodes ({e})") from e
            raise
        self.seq = seq

    def _by_tier(self, hashes: TierHashes) -> dict[int, list[int]]:
        if isinstance(hashes, Mapping):
            return {t: list(hs) for t, hs in hashes.items() if hs}
        hashes = list(hashes)
        return {self.tier: hashes} if hashes else {}

    def report_steps(self, steps: Iterable[StepReport]) -> None:
        """Append step reports to the node's capped stream (one round trip)."""
        steps = list(steps)
        if not steps:
            return
        p = self.r.pipeline(transaction=False)
        for s in steps:
            p.xadd(steps_key(self.ns, self.info.node_id),
                   {"new_tokens": s.new_tokens, "context_tokens": s.context_tokens, "seconds": s.seconds},
                   maxlen=STEP_STREAM_MAXLEN, approximate=True)
        p.execute()

    def deregister(self) -> None:
        """Leave the index: entries, slot, registry entry and step reports, in one script call."""
        drop_node_blocks(self.r, self.ns, self.info.node_id)
