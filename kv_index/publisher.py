"""Node side of the index: register, heartbeat load (the lease), publish block events and
step reports.

Events are applied by a server-side script (``schema.APPLY_EVENTS``) that checks the batch's
sequence number against the node's ``seq``: a batch that does not follow the last applied one
(a lost publish, a Redis restart, an expired lease whose entries were pruned) is refused as a
gap, and the node then replaces all its entries with its snapshot (``resync``). Each script
that changes entries also appends its event to the index's event stream, which routers' local
copies follow (kv_index/event_feed.py).

A node's lease is its HASH's TTL, refreshed by every heartbeat: when a node dies the HASH
expires within ``lease_s`` and readers stop seeing it, so it stops receiving work.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import redis

from kv_index.matmul_curve import format_curve
from kv_index.nodes import NodeInfo, StepReport
from kv_index.schema import (
    APPLY_EVENTS,
    DEFAULT_NS,
    LOAD_FIELDS,
    RESYNC,
    STEP_STREAM_MAXLEN,
    TIER_DEVICE,
    drop_node_blocks,
    event_keys,
    node_blocks_key,
    node_key,
    nodes_key,
    steps_key,
    tier_bit,
)

# Block hashes of one tier (the publisher's), or tier -> hashes.
TierHashes = Iterable[int] | Mapping[int, Iterable[int]]


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
        self._apply = client.register_script(APPLY_EVENTS)
        self._resync = client.register_script(RESYNC)

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
        p = self.r.pipeline(transaction=True)
        p.hexists(self._key, "seq")
        # Re-create identity fields too: a heartbeat after an expiry re-registers the node.
        p.hset(self._key, mapping={**fields, **self._identity()})
        p.pexpire(self._key, self.lease_ms)
        p.sadd(nodes_key(self.ns), self.info.node_id)
        intact = p.execute()[0]
        return bool(intact)

    def publish(self, stored: TierHashes = (), removed: TierHashes = (), cleared: bool = False) -> bool:
        """Apply one batch of block events (chained hashes) in one round trip, as batch
        ``seq + 1``: ``cleared`` first, then the removals, then the stores. ``stored`` and
        ``removed`` are hashes of this publisher's ``tier``, or tier -> hashes. Returns False
        on a gap (nothing applied): call ``resync``."""
        stored, removed = self._by_tier(stored), self._by_tier(removed)
        if not (stored or removed or cleared):
            return True
        nid = self.info.node_id
        args: list = [self.ns, nid, self.seq + 1, time.time(), "1" if cleared else "0"]
        for op, groups in (("-", removed), ("+", stored)):
            for tier, hashes in groups.items():
                args += [op, tier, len(hashes), *[f"{h:016x}" for h in hashes]]
        ok, _ = self._apply(keys=[self._key, node_blocks_key(self.ns, nid), *event_keys(self.ns)], args=args)
        if ok:
            self.seq += 1
        return bool(ok)

    def resync(self, held: Iterable[int] | Mapping[int, int]) -> None:
        """Replace every entry of this node with ``held`` (its snapshot: hashes of this
        publisher's ``tier``, or hash -> tier mask, ``schema.tier_bit``), re-registering it if
        its lease had lapsed; one round trip plus the registry refresh."""
        nid = self.info.node_id
        p = self.r.pipeline(transaction=True)
        p.hset(self._key, mapping={**self._identity(), "updated_at": time.time()})
        p.pexpire(self._key, self.lease_ms)
        p.sadd(nodes_key(self.ns), nid)
        p.execute()
        seq = self.seq + 1
        masks: dict[int, list[str]] = {}
        if isinstance(held, Mapping):
            for h, mask in held.items():
                if mask:
                    masks.setdefault(mask, []).append(f"{h:016x}")
        else:
            masks[tier_bit(self.tier)] = [f"{h:016x}" for h in held]
        args: list = [self.ns, nid, seq, time.time()]
        for mask, hexes in masks.items():
            if hexes:
                args += [mask, len(hexes), *hexes]
        self._resync(keys=[self._key, node_blocks_key(self.ns, nid), *event_keys(self.ns)], args=args)
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
        p = self.r.pipeline(transaction=True)
        self._drop_blocks(p)
        p.delete(self._key, steps_key(self.ns, self.info.node_id))
        p.srem(nodes_key(self.ns), self.info.node_id)
        p.execute()

    def _drop_blocks(self, p) -> None:
        drop_node_blocks(self.r, p, self.ns, self.info.node_id)
