"""The role each node should serve, as asked for by the planner or an operator: a wish, bound
to a cluster generation, with an expiry and the floors a switch must leave standing.

    {ns}:generation              STRING the cluster generation: set by the start path of a fresh
                                        cluster (`pdserve up`, `pdserve nodes` with no node to
                                        adopt: ``start_generation``), which also drops every wish
    {ns}:role:desired            HASH   node id -> the wish, JSON {role, gen, until, reason, floors, id}
    {ns}:role:refused            HASH   node id -> JSON {id, reason}: the node will not obey wish ``id``
                                        (its config rules the role out); a later wish is new
    {ns}:role:switching:{id}     STRING the generation, PEXPIRE the drain's bound: node ``id`` won a
                                        ``claim`` and is leaving its role (others count it gone)

Why a wish is more than a role: a persisted Redis (the chart's) outlives the cluster that wrote
its wishes, and node ids come back (``decode-0`` in every `pdserve up`), so a wish from an earlier
run used to turn the only decode node of a fresh one into a prefill node, for good. Now a wish of
another generation, or past ``until`` (the Redis server's clock, so the hosts' clocks never
matter), is no wish; and a node obeys one only through ``claim``, which refuses, in one script
run, a switch that would leave its role with fewer serving nodes than the wish's floor (never
fewer than ``DEFAULT_FLOORS``: one decode node, the only role that can serve alone; a decode node
prefills too, so it is also the cluster's last prefill-capable node).

A node reads its own entry on its heartbeat thread and switches live when it differs from the role
it serves (node/role_switch.py); its registry entry (kv_index/nodes.py NodeInfo.role) says the role
it serves *now*, so placement never reads this store. An entry outlives the switch until it
expires: a node restarted by Ray comes back in its configured role, then switches again.

Every call is one round trip on the caller's client, whose waits are bounded
(kv_index/client.py): a Redis that does not answer raises ``redis.RedisError``.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis

from kv_index.client import execute_with_time
from kv_index.nodes import Role
from kv_index.schema import nodes_key, tag

# How long a wish stands unless its writer says otherwise: past the longest switch (a drain's
# bound and a few retries), short enough that a wish nobody renews stops steering restarts.
WISH_TTL_S = 600.0
# The least a switch leaves of each role, whatever a wish says (see the module's docstring).
DEFAULT_FLOORS = {Role.PREFILL: 0, Role.DECODE: 1}


def generation_key(ns: str) -> str:
    return f"{tag(ns)}:generation"


def desired_key(ns: str) -> str:
    return f"{tag(ns)}:role:desired"


def refused_key(ns: str) -> str:
    return f"{tag(ns)}:role:refused"


def reason_key(ns: str) -> str:
    """Where an older build kept a wish's reason (now inside the wish): dropped with the wishes."""
    return f"{tag(ns)}:role:reason"


def switching_prefix(ns: str) -> str:
    return f"{tag(ns)}:role:switching:"


def start_generation(r: redis.Redis, ns: str) -> str:
    """A fresh cluster on this namespace: a new generation, and no wish of an earlier one (role
    wishes, refusals, pool targets) is left to obey. Returns the generation. Pool ids stay
    (kv_index/pool_targets.py): an id once issued is never made again."""
    from kv_index.pool_targets import targets_key  # the targets belong to the generation too

    gen = f"{int(time.time())}-{uuid.uuid4().hex[:12]}"
    p = r.pipeline(transaction=True)
    p.set(generation_key(ns), gen)
    p.delete(desired_key(ns), refused_key(ns), reason_key(ns), targets_key(ns))
    p.execute()
    return gen


def generation_and_time(r: redis.Redis, ns: str) -> tuple[str, float]:
    """The current generation ("" where no start path set one) and the Redis server's clock."""
    p = r.pipeline(transaction=False)
    p.get(generation_key(ns))
    gen, (sec, usec) = execute_with_time(r, p, generation_key(ns), 1)
    return (gen or b"").decode(), sec + usec / 1e6


def _floors(floors: Mapping[Role | str, int] | None) -> dict[str, int]:
    out = {r.value: DEFAULT_FLOORS[r] for r in Role}
    for role, n in (floors or {}).items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"a role floor is an int >= 0, got {Role(role).value}={n!r}")
        out[Role(role).value] = max(n, DEFAULT_FLOORS[Role(role)])
    return out


def encode_wish(role: Role | str, reason: str, gen: str, now: float, ttl_s: float,
                floors: Mapping[Role | str, int] | None = None) -> str:
    """One wish as stored (``RoleStore.request``, and the planner's targets written with their
    wishes in one transaction: kv_index/pool_targets.py). ValueError for a bad role, TTL or floor."""
    role = Role(role)  # a bad name is refused here, never stored
    if not (ttl_s > 0 and math.isfinite(ttl_s)):
        raise ValueError(f"a role wish's ttl_s must be a finite number of seconds > 0, got {ttl_s}")
    return json.dumps({"role": role.value, "gen": gen, "until": now + ttl_s, "reason": reason,
                       "floors": _floors(floors), "id": uuid.uuid4().hex[:12]})


@dataclass(frozen=True, slots=True)
class Wish:
    """A standing wish: ``role`` asked of a node until ``until`` (Redis clock)."""

    role: Role
    reason: str = ""
    until: float = 0.0
    floors: Mapping[Role, int] = field(default_factory=lambda: dict(DEFAULT_FLOORS))
    wish_id: str = ""
    refused: str = ""  # why the node will not obey it ("" = it may)

    def floor(self, role: Role) -> int:
        """The fewest serving nodes of ``role`` a switch away from it must leave."""
        return max(DEFAULT_FLOORS[Role(role)], int(self.floors.get(Role(role), 0)))


def decode_wish(raw: bytes | None, gen: str, now: float, refusal: bytes | None = None) -> Wish | None:
    """The stored wish if it stands: this generation's, not expired, a role this build knows
    (a newer planner's role is ignored, not a crash; so is an older build's bare role name,
    which carries neither a generation nor an expiry). Pure."""
    if raw is None:
        return None
    try:
        w = json.loads(raw)
        role, until, wish_gen = Role(w["role"]), float(w["until"]), str(w["gen"])
        floors = {Role(k): int(v) for k, v in (w.get("floors") or {}).items() if k in Role._value2member_map_}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if wish_gen != gen or not until > now:
        return None
    wish_id = str(w.get("id", ""))
    refused = ""
    if refusal is not None:
        try:
            r = json.loads(refusal)
            refused = str(r["reason"]) if r.get("id") == wish_id else ""
        except (ValueError, KeyError, TypeError, AttributeError):
            refused = ""
    return Wish(role, str(w.get("reason", "")), until, floors, wish_id, refused)


# Takes node ARGV[1] out of role ARGV[2] iff the serving nodes of that role besides it number at
# least ARGV[3]: the node's claim key is set (value: the generation, ARGV[4]; PEXPIRE ARGV[5] ms)
# and {1, others} returned; else {0, others}. "Serving": registered (its lease holds), not
# draining, and no claim of this generation of its own (it is leaving the role too). One
# script: two nodes that read the registry at once never both leave the last pair.
#   KEYS: {ns}:nodes    ARGV: node_id, role, floor, generation, hold_ms, the hash tag {ns}
CLAIM = """
local others = 0
for _, nid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if nid ~= ARGV[1] then
    local h = redis.call('HMGET', ARGV[6] .. ':node:' .. nid, 'role', 'draining')
    local draining = h[2] and h[2] ~= '0' and h[2] ~= ''
    if h[1] == ARGV[2] and not draining then
      local claim = redis.call('GET', ARGV[6] .. ':role:switching:' .. nid)
      if claim ~= ARGV[4] then others = others + 1 end
    end
  end
end
if others < tonumber(ARGV[3]) then return {0, others} end
redis.call('SET', ARGV[6] .. ':role:switching:' .. ARGV[1], ARGV[4], 'PX', ARGV[5])
return {1, others}
"""


class RoleStore:
    """Role wishes per node in the namespace ``namespace``."""

    def __init__(self, redis: redis.Redis, namespace: str) -> None:
        self.r = redis
        self.ns = namespace
        self._claim = redis.register_script(CLAIM)

    def request(self, node_id: str, role: Role, reason: str = "", *, ttl_s: float = WISH_TTL_S,
                floors: Mapping[Role | str, int] | None = None) -> None:
        """Ask ``node_id`` to serve ``role`` (it switches at its next heartbeat) for ``ttl_s``,
        leaving at least ``floors`` (role -> nodes, never below ``DEFAULT_FLOORS``) serving the
        role it leaves. The wish belongs to the generation current now: one written across a
        fresh start is dropped."""
        if not node_id:
            raise ValueError("node_id is required")
        gen, now = generation_and_time(self.r, self.ns)
        self.r.hset(desired_key(self.ns), node_id, encode_wish(role, reason, gen, now, ttl_s, floors))

    def wish(self, node_id: str) -> Wish | None:
        """The standing wish of ``node_id`` (refused or not), or None."""
        p = self.r.pipeline(transaction=False)
        p.get(generation_key(self.ns))
        p.hget(desired_key(self.ns), node_id)
        p.hget(refused_key(self.ns), node_id)
        gen, (sec, usec), raw, refusal = execute_with_time(self.r, p, generation_key(self.ns), 1)
        return decode_wish(raw, (gen or b"").decode(), sec + usec / 1e6, refusal)

    def desired(self, node_id: str) -> Role | None:
        """The role asked of ``node_id``; None when no wish stands or the node refused it."""
        w = self.wish(node_id)
        return w.role if w is not None and not w.refused else None

    def reason(self, node_id: str) -> str:
        w = self.wish(node_id)
        return w.reason if w is not None else ""

    def refuse(self, node_id: str, wish: Wish, reason: str) -> None:
        """``node_id`` will not obey ``wish`` (its config rules the role out): readers leave it
        out (the pool controller counts the node in the role it serves); a new wish is new."""
        self.r.hset(refused_key(self.ns), node_id, json.dumps({"id": wish.wish_id, "reason": reason}))

    def claim(self, node_id: str, from_role: Role, floor: int, hold_s: float) -> tuple[bool, int]:
        """Take ``node_id`` out of ``from_role`` for a switch, iff at least ``floor`` other nodes
        serve that role: (claimed, how many others do). The claim lapses after ``hold_s`` or
        at ``release``."""
        gen, _ = generation_and_time(self.r, self.ns)
        ok, others = self._claim(keys=[nodes_key(self.ns)],
                                 args=[node_id, Role(from_role).value, int(floor), gen,
                                       max(1, int(hold_s * 1000)), tag(self.ns)])
        return bool(ok), int(others)

    def release(self, node_id: str) -> None:
        """The switch is over (the registry shows the role served now)."""
        self.r.delete(switching_prefix(self.ns) + node_id)

    def clear(self, node_id: str) -> None:
        """Forget the wish: the node keeps the role it serves."""
        p = self.r.pipeline(transaction=True)
        p.hdel(desired_key(self.ns), node_id)
        p.hdel(refused_key(self.ns), node_id)
        p.hdel(reason_key(self.ns), node_id)
        p.execute()

    def wishes(self) -> dict[str, Wish]:
        """Node id -> its standing wish (refused ones included), one round trip."""
        p = self.r.pipeline(transaction=False)
        p.get(generation_key(self.ns))
        p.hgetall(desired_key(self.ns))
        p.hgetall(refused_key(self.ns))
        gen, (sec, usec), raw, refusals = execute_with_time(self.r, p, generation_key(self.ns), 1)
        gen, now = (gen or b"").decode(), sec + usec / 1e6
        out = {}
        for nid, value in raw.items():
            w = decode_wish(value, gen, now, refusals.get(nid))
            if w is not None:
                out[nid.decode()] = w
        return out

    def all(self) -> dict[str, Role]:
        """Node id -> desired role, for every node with a standing wish it has not refused."""
        return {nid: w.role for nid, w in self.wishes().items() if not w.refused}
