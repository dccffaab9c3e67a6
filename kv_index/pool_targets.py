"""Pool size targets in Redis: how many nodes of each role the cluster should run, with who set
them, why and when; and the log of what the pool controller did about them::

    {ns}:pool_targets    HASH  prefill, decode (node counts; a role left out has no target),
                               reason, by (who set them), at (wall clock), gen (the cluster
                               generation, kv_index/roles.py), until (Redis clock: the expiry)
    {ns}:pool_changes    LIST  the pool controller's last ``CHANGES_KEPT`` actions, newest first,
                               each a JSON object {role, action, node_id, reason, at}
    {ns}:pool_ids        HASH  role -> the highest node index the pool controller has issued or
                               removed: ids above it only are made, so none is ever reused
                               (kept across generations and controller restarts)

The planner (router/planner/) writes targets; the pool controller (deploy/pool_controller.py,
in `pdserve up` and `pdserve nodes --follow-targets`) reads them, clamps them to its bounds and
adds or removes node actors one at a time; `pdserve status` shows both. A target is a wish, not
a count: the controller never goes below its minimum nor above its maximum whatever is written.
Like a role wish it belongs to the cluster generation it was written in (a record of another is
none: the controller's defaults apply) and expires (an expired one is no target: every pool keeps
its size). The planner writes its targets and the role switches they count on in one transaction
(``set(..., wishes=...)``): the controller, which counts a node in the role it is wished to, never
sees one without the other.

Calls are single round trips (a transaction for ``set``), bounded by the client's timeouts:
build the client with ``kv_index.client.redis_client``.
"""
from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

import redis

from kv_index.client import execute_with_time
from kv_index.nodes import Role
from kv_index.roles import WISH_TTL_S, desired_key, encode_wish, generation_and_time, generation_key
from kv_index.schema import tag

CHANGES_KEPT = 50  # entries of the change log: enough for `pdserve status` and a post-mortem
META_FIELDS = ("reason", "by", "at", "gen", "until")


def targets_key(ns: str) -> str:
    return f"{tag(ns)}:pool_targets"


def changes_key(ns: str) -> str:
    return f"{tag(ns)}:pool_changes"


def ids_key(ns: str) -> str:
    return f"{tag(ns)}:pool_ids"


# HSET KEYS[1] ARGV[1] ARGV[2] unless it holds more already; -> the value held after.
RAISE = """
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
local n = tonumber(ARGV[2])
if n > cur then redis.call('HSET', KEYS[1], ARGV[1], n) return n end
return cur
"""


@dataclass(frozen=True, slots=True)
class TargetRecord:
    """The targets as last set, with their provenance."""

    targets: dict[Role, int]
    reason: str = ""
    by: str = ""  # who set them: "planner@host:pid", an operator's name
    at: float = 0.0  # wall clock
    until: float = math.inf  # Redis clock: past it the targets are no targets (``expired``)
    expired: bool = False  # as of the read


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
        self._raise = redis.register_script(RAISE)

    def set(self, targets: Mapping[Role, int], reason: str = "", *, by: str | None = None,
            ttl_s: float = WISH_TTL_S, wishes: Mapping[str, Role] | None = None,
            floors: Mapping[Role, int] | None = None) -> None:
        """Replace the targets for ``ttl_s``: roles not in ``targets`` have none afterwards (the
        controller leaves their pools as they are). ``wishes`` (node id -> role: the switches the
        targets count on) are written in the same transaction, as ``RoleStore.request`` would with
        ``floors``. ValueError for a count below 0, an unknown role, a bad TTL or floor."""
        clean = {}
        for role, n in targets.items():
            role = Role(role)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"a pool target is an int >= 0, got {role.value}={n!r}")
            clean[role.value] = n
        if not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise ValueError(f"pool targets' ttl_s must be a finite number of seconds > 0, got {ttl_s}")
        gen, now = generation_and_time(self.r, self.ns)
        encoded = {nid: encode_wish(role, reason, gen, now, ttl_s, floors) for nid, role in (wishes or {}).items()}
        key = targets_key(self.ns)
        p = self.r.pipeline(transaction=True)
        p.delete(key)
        p.hset(key, mapping={**clean, "reason": reason, "by": by if by is not None else default_author(),
                             "at": time.time(), "gen": gen, "until": now + ttl_s})
        if encoded:
            p.hset(desired_key(self.ns), mapping=encoded)
        p.execute()

    def get(self) -> dict[Role, int]:
        """Targets per role ({} = none set, or expired)."""
        rec = self.record()
        return rec.targets if rec is not None and not rec.expired else {}

    def record(self) -> TargetRecord | None:
        """The targets with who set them, why, when and until when; None when never set in this
        cluster generation (a record of an earlier one is ignored)."""
        p = self.r.pipeline(transaction=False)
        p.hgetall(targets_key(self.ns))
        p.get(generation_key(self.ns))
        raw, gen, (sec, usec) = execute_with_time(self.r, p, generation_key(self.ns), 2)
        h = {k.decode(): v.decode() for k, v in raw.items()}
        if not h or h.get("gen", "") != (gen or b"").decode():
            return None
        targets = {}
        for role in Role:
            try:
                targets[role] = max(0, int(h[role.value]))
            except (KeyError, ValueError):  # no target for this role (or a hand-written bad one)
                continue
        at, until = _number(h.get("at"), 0.0), _number(h.get("until"), 0.0)  # no expiry written: expired
        return TargetRecord(targets, h.get("reason", ""), h.get("by", ""), at, until,
                            expired=not until > sec + usec / 1e6)

    def clear(self) -> None:
        self.r.delete(targets_key(self.ns))

    def issued(self) -> dict[Role, int]:
        """Role -> the highest node index issued or removed so far (-1: none): the pool
        controller makes ids above it only."""
        raw = self.r.hgetall(ids_key(self.ns))
        out = {role: -1 for role in Role}
        for k, v in raw.items():
            try:
                out[Role(k.decode())] = int(v)
            except ValueError:
                continue
        return out

    def retire(self, role: Role, index: int) -> int:
        """Index ``index`` of ``role`` is used (issued to a new node, or its node removed): never
        made again. Returns the highest retired index of the role."""
        return int(self._raise(keys=[ids_key(self.ns)], args=[Role(role).value, int(index)]))

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


def _number(text: str | None, default: float) -> float:
    try:
        return float(text) if text is not None else default
    except ValueError:
        return default
