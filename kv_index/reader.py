"""Router side of the index: the live nodes and, per node, how many leading prompt blocks it
holds. Any number of routers read the same keys.

A lookup is one script call (``schema.MATCH``): it walks the prompt's block keys in Redis and
returns, per live node, its leading matched blocks and how many of them sit only in its host
memory or on its disk (``PrefixMatch``), so a 4k-token prompt costs one round trip whatever
its block count. Entries of dead nodes are ignored (lookups only count live ones) and
removed by ``prune_dead`` (whose script appends the removal to the index's event stream).

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
    MATCH,
    STEP_STREAM_MAXLEN,
    block_key,
    drop_node_blocks,
    node_key,
    nodes_key,
    steps_key,
)

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

    def live_nodes(self) -> dict[str, NodeInfo]:
        ids = sorted(x.decode() for x in self.r.smembers(nodes_key(self.ns)))
        p = self.r.pipeline(transaction=False)
        for nid in ids:
            p.hgetall(node_key(self.ns, nid))
        self.round_trips += 2
        out = {}
        for nid, h in zip(ids, p.execute()):
            if not h:
                continue  # lease expired: prune_dead removes the id
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
        flat = self._match(keys=[block_key(self.ns, h) for h in block_hashes], args=list(node_ids))
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
        """Forget nodes whose lease expired and remove their index entries."""
        ids = [x.decode() for x in self.r.smembers(nodes_key(self.ns))]
        p = self.r.pipeline(transaction=False)
        for nid in ids:
            p.exists(node_key(self.ns, nid))
        dead = [nid for nid, alive in zip(ids, p.execute()) if not alive]
        for nid in dead:
            p = self.r.pipeline(transaction=True)
            drop_node_blocks(self.r, p, self.ns, nid)
            p.delete(steps_key(self.ns, nid))
            p.srem(nodes_key(self.ns), nid)
            p.execute()
        return dead
