"""The role each node should serve, as asked for by the planner or an operator.

One Redis HASH per namespace, node id -> role (plain strings, "prefill" / "decode"), and one
beside it for why (a log line's worth of text, for `pdserve status`). A node reads its own
entry on its heartbeat thread and switches live when it differs from the role it serves
(node/role_switch.py); its registry entry (kv_index/nodes.py NodeInfo.role) says the role it
serves *now*, so placement never reads this store. An entry outlives the switch: it is the
wish, and a node restarted by Ray comes back in its configured role, then switches again.

Every call is one round trip on the caller's client, whose waits are bounded
(kv_index/client.py): a Redis that does not answer raises ``redis.RedisError``.
"""
from __future__ import annotations

import redis

from kv_index.nodes import Role


def desired_key(ns: str) -> str:
    return f"{ns}:role:desired"


def reason_key(ns: str) -> str:
    return f"{ns}:role:reason"


class RoleStore:
    """Desired role per node in the namespace ``namespace``."""

    def __init__(self, redis: redis.Redis, namespace: str) -> None:
        self.r = redis
        self.ns = namespace

    def request(self, node_id: str, role: Role, reason: str = "") -> None:
        """Ask ``node_id`` to serve ``role`` (it switches at its next heartbeat)."""
        role = Role(role)  # a bad name is refused here, never stored
        if not node_id:
            raise ValueError("node_id is required")
        p = self.r.pipeline(transaction=True)
        p.hset(desired_key(self.ns), node_id, role.value)
        p.hset(reason_key(self.ns), node_id, reason)
        p.execute()

    def desired(self, node_id: str) -> Role | None:
        """The role asked of ``node_id``; None when none was (or it is not a role this build
        knows: a newer planner's wish is ignored, not a crash)."""
        raw = self.r.hget(desired_key(self.ns), node_id)
        return _role(raw)

    def reason(self, node_id: str) -> str:
        raw = self.r.hget(reason_key(self.ns), node_id)
        return raw.decode() if raw else ""

    def clear(self, node_id: str) -> None:
        """Forget the wish: the node keeps the role it serves."""
        p = self.r.pipeline(transaction=True)
        p.hdel(desired_key(self.ns), node_id)
        p.hdel(reason_key(self.ns), node_id)
        p.execute()

    def all(self) -> dict[str, Role]:
        """Node id -> desired role, for every node with a wish (unknown roles left out)."""
        out = {}
        for nid, raw in self.r.hgetall(desired_key(self.ns)).items():
            role = _role(raw)
            if role is not None:
                out[nid.decode()] = role
        return out


def _role(raw: bytes | None) -> Role | None:
    if raw is None:
        return None
    try:
        return Role(raw.decode())
    except ValueError:
        return None
