"""Node health records in Redis: why a node is unhealthy or down, kept where `pdserve status`
and `pdserve nodes` read it, beside (not in) the registry::

    {ns}:health               SET   node ids that have a record
    {ns}:health:{node_id}     HASH  state, reason, at (wall clock), failures, restarts

A node leaves the registry when it turns unhealthy or stays down, so its registry entry cannot
say why; this record can, and outlives it (``RECORD_TTL_S`` after its last write). States:

    starting    a start is under way (``failures``: failed lives before it, this one counted)
    serving     started and registered
    unhealthy   its engine failed (``reason``); it left the index and its actor restarts
    down        it failed ``failures`` times in a row and is not restarted (``reason``)

Written by the node itself (node/actor.py, node/server.py), read by anyone. Plain fields, no
scripts: each write is one transaction of the node's own keys.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from kv_index.schema import tag

STARTING, SERVING, UNHEALTHY, DOWN = "starting", "serving", "unhealthy", "down"
# A record nobody rewrote for this long goes (a node removed for good leaves no trace forever).
RECORD_TTL_S = 7 * 24 * 3600


def health_set_key(ns: str) -> str:
    return f"{tag(ns)}:health"


def health_key(ns: str, node_id: str) -> str:
    return f"{tag(ns)}:health:{node_id}"


@dataclass(frozen=True, slots=True)
class HealthRecord:
    node_id: str
    state: str
    reason: str = ""
    at: float = 0.0  # when the state was written (wall clock)
    failures: int = 0  # failed lives in a row (node/health.py StartPolicy)
    restarts: int = 0  # lives that ended unhealthy or failed, since the record began

    @staticmethod
    def from_hash(node_id: str, h: dict[bytes, bytes]) -> HealthRecord:
        g = {k.decode(): v.decode() for k, v in h.items()}
        return HealthRecord(node_id=node_id, state=g.get("state", ""), reason=g.get("reason", ""),
                            at=float(g.get("at", 0.0)), failures=int(g.get("failures", 0)),
                            restarts=int(g.get("restarts", 0)))


class HealthStore:
    """Reads and writes the health records of namespace ``ns``."""

    def __init__(self, client: redis.Redis, ns: str) -> None:
        self.r = client
        self.ns = ns

    def write(self, node_id: str, state: str, reason: str | None = None, **counts: int) -> None:
        """Set ``state``, and ``reason`` and the counts (``failures``, ``restarts``) when given:
        a node that serves again keeps the reason of its last failure."""
        key = health_key(self.ns, node_id)
        fields = {"state": state, "at": time.time(), **counts}
        if reason is not None:
            fields["reason"] = reason
        p = self.r.pipeline(transaction=True)
        p.hset(key, mapping=fields)
        p.expire(key, RECORD_TTL_S)
        p.sadd(health_set_key(self.ns), node_id)
        p.execute()

    def read(self, node_id: str) -> HealthRecord | None:
        h = self.r.hgetall(health_key(self.ns, node_id))
        return HealthRecord.from_hash(node_id, h) if h else None

    def read_all(self) -> dict[str, HealthRecord]:
        """Every record, by node id (two round trips)."""
        ids = sorted(x.decode() for x in self.r.smembers(health_set_key(self.ns)))
        p = self.r.pipeline(transaction=False)
        for nid in ids:
            p.hgetall(health_key(self.ns, nid))
        out, gone = {}, []
        for nid, h in zip(ids, p.execute()):
            if h:
                out[nid] = HealthRecord.from_hash(nid, h)
            else:
                gone.append(nid)
        if gone:  # expired records: forget their ids too
            self.r.srem(health_set_key(self.ns), *gone)
        return out

    def clear(self, node_id: str) -> None:
        p = self.r.pipeline(transaction=True)
        p.delete(health_key(self.ns, node_id))
        p.srem(health_set_key(self.ns), node_id)
        p.execute()
