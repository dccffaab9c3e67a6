"""Pool size targets in Redis: how many nodes of each role the cluster should run, with who set
them, why and when; and the log of what the pool controller did about them::

    {ns}:pool_targets    HASH  prefill, decode (node counts; a role left out has no target),
                               reason, by (who set them), at (wall clock)
    {ns}:pool_changes    LIST  the pool controller's last ``CHANGES_KEPT`` actions, newest first,
                               each a JSON object {role, action, node_id, reason, at}

The planner (router/planner/) writes targets; the pool controller (deploy/pool_controller.py,
in `pdserve up` and `pdserve nodes --follow-targets`) reads them, clamps them to its bounds and
adds or removes node actors one at a time; `pdserve status` shows both. A target is a wish, not
a count: the controller never goes below its minimum nor above its maximum whatever is written.

Calls are single round trips (a transaction for ``set``), bounded by the client's timeouts:
build the client with ``kv_index.client.redis_client``.
"""
from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

import redis

from kv_index.nodes import Role

CHANGES_KEPT = 50  # entries of the change log: enough for `pdserve status` and a post-mortem
META_FIELDS = ("reason", "by", "at")


def targets_key(ns: str) -> str:
    return f"{ns}:pool_targets"


def changes_key(ns: str) -> str:
    return f"{ns}:pool_changes"


@dataclass(frozen=True, slots=True)
class TargetRecord:
    """The targets as last set, with their provenance."""

    targets: dict[Role, int]
    reason: str = ""
    by: str = ""  # who set them: "planner@host:pid", an operator's name
    at: float = 0.0  # wall clock


@dataclass(frozen=True, slots=True)
class ChangeRecord:
    """One thing the pool controller did: ``action`` is "add" or "remove"."""

    role: Role
    action: str
    node_id: str
    reason: str = ""
    at: float = 0.0


def default_author() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class PoolTargets:
    """Reads and writes the pool targets (and the change log) of namespace ``namespace``."""

    def __init__(self, redis: redis.Redis, namespace: str) -> None:
        self.r = redis
        self.ns = namespace

    def set(self, targets: Mapping[Role, int], reason: str = "", *, by: str | None = None) -> None:
        """Replace the targets: roles not in ``targets`` have none afterwards (the controller
        leaves their pools as they are). ValueError for a count below 0 or an unknown role."""
        clean = {}
        for role, n in targets.items():
            role = Role(role)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"a pool target is an int >= 0, got {role.value}={n!r}")
            clean[role.value] = n
        key = targets_key(self.ns)
        p = self.r.pipeline(transaction=True)
        p.delete(key)
        p.hset(key, mapping={**clean, "reason": reason, "by": by if by is not None else default_author(),
                             "at": time.time()})
        p.execute()

    def get(self) -> dict[Role, int]:
        """Targets per role ({} = none set)."""
        rec = self.record()
        return rec.targets if rec is not None else {}

    def record(self) -> TargetRecord | None:
        """The targets with who set them, why and when; None when never set."""
        h = {k.decode(): v.decode() for k, v in self.r.hgetall(targets_key(self.ns)).items()}
        if not h:
            return None
        targets = {}
        for role in Role:
            try:
                targets[role] = max(0, int(h[role.value]))
            except (KeyError, ValueError):  # no target for this role (or a hand-written bad one)
                continue
        try:
            at = float(h.get("at", 0.0))
        except ValueError:
            at = 0.0
        return TargetRecord(targets, h.get("reason", ""), h.get("by", ""), at)

    def clear(self) -> None:
        self.r.delete(targets_key(self.ns))

    def note_change(self, role: Role, action: str, node_id: str, reason: str = "") -> None:
        """Log one action of the pool controller (the newest ``CHANGES_KEPT`` are kept)."""
        entry = json.dumps({"role": Role(role).value, "action": action, "node_id": node_id, "reason": reason,
                            "at": time.time()})
        p = self.r.pipeline(transaction=True)
        p.lpush(changes_key(self.ns), entry)
        p.ltrim(changes_key(self.ns), 0, CHANGES_KEPT - 1)
        p.execute()

    def changes(self, limit: int = 10) -> list[ChangeRecord]:
        """The newest ``limit`` actions, newest first (malformed entries skipped)."""
        out = []
        for raw in self.r.lrange(changes_key(self.ns), 0, max(0, limit - 1)):
            try:
                e = json.loads(raw)
                out.append(ChangeRecord(Role(e["role"]), str(e["action"]), str(e["node_id"]),
                                        str(e.get("reason", "")), float(e.get("at", 0.0))))
            except (ValueError, KeyError, TypeError):
                continue
        return out
