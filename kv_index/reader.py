"""Router side of the index: the live nodes and, per node, how many leading prompt blocks it
holds. Any number of routers read the same keys.

A lookup is one script call (``scripts.MATCH``): it walks the prompt's blocks in Redis and
returns, per live node, its leading matched blocks and how many of them sit only in its host
memory or on its disk (``PrefixMatch``), so a 4k-token prompt costs one round trip whatever
its block count. Entries of dead nodes (lease lapsed on Redis's clock) are ignored (lookups
only count live ones) and removed by ``prune_dead`` (whose script appends the removal to the
index's event stream).

A router by default answers ``match`` from its own copy of the index instead
(kv_index/local_index.py, fed by kv_index/event_feed.py): the same answer without the round
trip. This reader remains the durable copy's, the copy's fallback until it has synced, and
the ``--index-lookup redis`` path.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import redis

from kv_index.nodes import NodeInfo, PrefixMatch, StepReport
from kv_index.schema import (
    DEFAULT_NS,
    STEP_STREAM_MAXLEN,
    drop_node_blocks,
    nodes_key,
    pack_hashes,
    slots_key,
    steps_key,
    tag,
)
from kv_index.scripts import LIVE_NODES, MATCH

log = logging.getLogger(__name__)
NO_MATCH = PrefixMatch(0)


class IndexReader:
    """Router side: live nodes and, per node, how many leading prompt blocks it holds.

    ``round_trips`` counts every Redis round trip this reader made (``match`` makes one)."""

    def __init__(self, client: redis.Redis, ns: str = DEFAULT_NS) -> None:
        self.r = client
        self.ns = ns
        self.round_trips = 0
        self._match = client.register_script(MATCH)
        self._live = client.register_script(LIVE_NODES)
        self._tag, self._slots = tag(ns), slots_key(ns)

    def registry(self) -> tuple[int, dict[str, dict[bytes, bytes]]]:
        """Redis's clock (ms) and every registered node's HASH, in one round trip."""
        flat = self._live(keys=[nodes_key(self.ns)], args=[self._tag])
        self.round_trips += 1
        hashes = {flat[i].decode(): dict(zip(flat[i + 1][::2], flat[i + 1][1::2])) for i in range(1, len(flat), 2)}
        return int(flat[0]), hashes

    def live_nodes(self) -> dict[str, NodeInfo]:
        now_ms, hashes = self.registry()
        out = {}
        for nid in sorted(hashes):
            h = hashes[nid]
            if not h or int(h.get(b"lease_until", 0)) <= now_ms:
                continue  # lease lapsed: prune_dead removes the node
            try:
                out[nid] = NodeInfo.from_hash(nid, h)
            except (KeyError, ValueError) as e:  # a newer node kind, or a half-written entry
                log.warning("node %s skipped: registry entry not understood (%s)", nid, e)
        return out

    def match(self, block_hashes: Sequence[int], node_ids: Sequence[str]) -> dict[str, PrefixMatch]:
        """Leading blocks of ``block_hashes`` each of ``node_ids`` holds, in any tier, each
        counted in the fastest tier the node holds it in: one script call, one round trip,
        whatever the number of blocks. Every id is in the result (``PrefixMatch(0)``: none)."""
        out = {n: NO_MATCH for n in node_ids}
        if not block_hashes or not node_ids:
            return out
        flat = self._match(keys=[self._slots],
                           args=[self._tag, len(node_ids), *node_ids, pack_hashes(block_hashes)])
        self.round_trips += 1
        for i in range(0, len(flat), 4):
            out[flat[i].decode()] = PrefixMatch(int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]))
        return out

    def read_steps(self, after: Mapping[str, str]) -> dict[str, tuple[list[StepReport], str]]:
        """Step reports newer than stream id ``after[node_id]`` ("0-0": all) of each node, in one
        pipelined round trip -> node id -> (reports, last id seen)."""
        ids = list(after)
        if not ids:
            return {}
        p = self.r.pipeline(transaction=False)
        for nid in ids:
            p.xrange(steps_key(self.ns, nid), min=f"({after[nid]}", count=STEP_STREAM_MAXLEN)
        self.round_trips += 1
        out = {}
        for nid, rows in zip(ids, p.execute()):
            reports = [StepReport(int(f[b"new_tokens"]), int(f[b"context_tokens"]), float(f[b"seconds"]))
                       for _, f in rows]
            out[nid] = (reports, rows[-1][0].decode() if rows else after[nid])
        return out

    def prune_dead(self) -> list[str]:
        """Forget nodes whose lease lapsed and remove their index entries (each checked again
        in its removal's script: a node that renewed meanwhile stays)."""
        now_ms, hashes = self.registry()
        dead = []
        for nid, h in hashes.items():
            if int(h.get(b"lease_until", 0)) <= now_ms and drop_node_blocks(self.r, self.ns, nid, only_if_dead=True) >= 0:
                dead.append(nid)
        return sorted(dead)
