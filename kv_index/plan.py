"""The planner's plan and its leader lease in Redis: one planner per cluster, however many
routers share the Redis::

    {ns}:planner:leader   STRING  the leading planner's id ("router@host:pid/..."); PX = the lease
    {ns}:plan             STRING  the current plan, a JSON object: leader, at (wall clock), mode,
                                  applied (false: advisory, nothing was changed), action, reason,
                                  detail, layout {prefill, decode}, threshold, roles, pool_targets,
                                  figures

A planner that holds the lease decides and publishes; the others read the plan and apply its
threshold when it was applied (router/planner/loop.py). Taking and renewing the lease is one
Lua script (SET NX PX, or PEXPIRE when the holder is the caller), so only the holder renews and
a lapsed lease goes to the first planner that asks. Every call is a single round trip bounded
by the client's timeouts (``kv_index.client.redis_client``): a hung Redis makes the planner
stand still (no leader can renew, none can take over), never the router.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import redis

from kv_index.schema import tag

_LEAD = """
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def leader_key(ns: str) -> str:
    return f"{tag(ns)}:planner:leader"


def plan_key(ns: str) -> str:
    return f"{tag(ns)}:plan"


@dataclass(frozen=True, slots=True)
class Leader:
    holder: str
    ttl_s: float  # seconds left on the lease


class PlanStore:
    """The plan record and the leader lease of namespace ``namespace``."""

    def __init__(self, redis: redis.Redis, namespace: str) -> None:
        self.r = redis
        self.ns = namespace
        self._lead = redis.register_script(_LEAD)
        self._release = redis.register_script(_RELEASE)

    def lead(self, holder: str, lease_s: float) -> bool:
        """Take the lease if nobody holds it, renew it if ``holder`` does; whether ``holder``
        leads now (for ``lease_s`` more seconds)."""
        return bool(self._lead(keys=[leader_key(self.ns)], args=[holder, max(1, int(lease_s * 1000))]))

    def release(self, holder: str) -> bool:
        """Give the lease up (a router that stops), if ``holder`` holds it."""
        return bool(self._release(keys=[leader_key(self.ns)], args=[holder]))

    def leader(self) -> Leader | None:
        p = self.r.pipeline(transaction=False)
        p.get(leader_key(self.ns))
        p.pttl(leader_key(self.ns))
        holder, ttl = p.execute()
        if holder is None:
            return None
        return Leader(holder.decode(), max(ttl, 0) / 1000)

    def publish(self, plan: dict) -> None:
        self.r.set(plan_key(self.ns), json.dumps(plan, sort_keys=True))

    def read(self) -> dict | None:
        """The current plan; None when none was published (or it is not a JSON object)."""
        raw = self.r.get(plan_key(self.ns))
        if raw is None:
            return None
        try:
            plan = json.loads(raw)
        except ValueError:
            return None
        return plan if isinstance(plan, dict) else None
