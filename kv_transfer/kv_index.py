"""The global KV-block index and node registry in Redis: key schema, node side, reader side.

Torch-free and Ray-free: nodes publish through ``NodePublisher``; routers (any number of
replicas, all reading the same keys) read through ``IndexReader``. The index is a hint: a stale
entry costs a cache miss on the chosen node (which verifies tokens before reusing a block),
never a wrong answer.

Key schema (``ns`` defaults to ``pdserve``; several clusters can share one Redis)::

    {ns}:nodes                  SET    node ids ever registered (readers prune dead ones)
    {ns}:node:{node_id}         HASH   role, grpc address, model fingerprint, block size,
                                       num_blocks + load (waiting, running, running_tokens,
                                       free_blocks, kv_usage, updated_at)
                                       + seq (last applied event batch), event_at (node clock
                                       when it was published); PEXPIRE = the lease
    {ns}:blk:{hash:016x}        HASH   node id -> storage tier ("0" device, "1" host, "2" disk)
                                       of the KV block with this chained hash
    {ns}:nodeblk:{node_id}      SET    hashes a node has published (cleanup and resync)
    {ns}:steps:{node_id}        STREAM the node's step reports (new_tokens, context_tokens,
                                       seconds), capped: the router fits its cost model on them

Events are applied by a server-side script that checks the batch's sequence number against
the node's ``seq``: a batch that does not follow the last applied one (a lost publish, a Redis
restart, an expired lease whose entries were pruned) is refused as a gap, and the node then
replaces all its entries with its snapshot (``resync``). A lookup is one script call: it walks
the prompt's block keys in Redis and returns, per live node, its leading matched blocks, so a
4k-token prompt costs one round trip whatever its block count.

A node's lease is its HASH's TTL, refreshed by every heartbeat: when a node dies the HASH
expires within ``lease_s`` and readers stop seeing it, so it stops receiving work; its block
entries are ignored from then on (lookups only count live nodes) and removed by ``prune_dead``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import redis

DEFAULT_NS = "pdserve"
LOAD_FIELDS = ("waiting", "running", "running_tokens", "free_blocks", "num_blocks", "kv_usage")
TIER_DEVICE, TIER_HOST, TIER_DISK = 0, 1, 2
STEP_STREAM_MAXLEN = 512  # step reports kept per node: enough for the router's fit window


def node_key(ns: str, node_id: str) -> str:
    return f"{ns}:node:{node_id}"


def nodes_key(ns: str) -> str:
    return f"{ns}:nodes"


def block_key(ns: str, block_hash: int) -> str:
    return f"{ns}:blk:{block_hash:016x}"


def node_blocks_key(ns: str, node_id: str) -> str:
    return f"{ns}:nodeblk:{node_id}"


def steps_key(ns: str, node_id: str) -> str:
    return f"{ns}:steps:{node_id}"


# Applies one event batch iff it follows the last applied one.
#   KEYS: node HASH, node's block SET
#   ARGV: ns, node_id, seq, event_at, cleared (0/1), n_removed, removed hex..., tier, stored hex...
#   -> {1, seq} applied; {0, last_seq or -1} gap (nothing applied)
# The node HASH missing (lease expired, Redis restarted) is a gap too: whatever the index held
# for the node may have been pruned, so only a full snapshot restores it.
_APPLY_EVENTS = """
local last = redis.call('HGET', KEYS[1], 'seq')
local seq = tonumber(ARGV[3])
if (not last) or tonumber(last) ~= seq - 1 then
  return {0, last and tonumber(last) or -1}
end
local ns, nid = ARGV[1], ARGV[2]
if ARGV[5] == '1' then
  for _, hx in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    redis.call('HDEL', ns .. ':blk:' .. hx, nid)
  end
  redis.call('DEL', KEYS[2])
end
local nrem = tonumber(ARGV[6])
for i = 7, 6 + nrem do
  redis.call('HDEL', ns .. ':blk:' .. ARGV[i], nid)
  redis.call('SREM', KEYS[2], ARGV[i])
end
local tier = ARGV[7 + nrem]
for i = 8 + nrem, #ARGV do
  redis.call('HSET', ns .. ':blk:' .. ARGV[i], nid, tier)
  redis.call('SADD', KEYS[2], ARGV[i])
end
redis.call('HSET', KEYS[1], 'seq', seq, 'event_at', ARGV[4])
return {1, seq}
"""

# Replaces all of a node's entries with its snapshot and sets its sequence number.
#   KEYS: node HASH, node's block SET;  ARGV: ns, node_id, seq, event_at, tier, hex...
_RESYNC = """
local ns, nid = ARGV[1], ARGV[2]
for _, hx in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  redis.call('HDEL', ns .. ':blk:' .. hx, nid)
end
redis.call('DEL', KEYS[2])
for i = 6, #ARGV do
  redis.call('HSET', ns .. ':blk:' .. ARGV[i], nid, ARGV[5])
  redis.call('SADD', KEYS[2], ARGV[i])
end
redis.call('HSET', KEYS[1], 'seq', ARGV[3], 'event_at', ARGV[4])
return #ARGV - 5
"""

# Leading blocks held per candidate node, walking the chain in Redis.
#   KEYS: block keys in prompt order;  ARGV: candidate node ids
#   -> flat {node_id, matched_blocks, worst_tier, ...} for nodes with a match
# The walk stops at the first block no remaining candidate holds, so a miss costs one HGETALL.
_MATCH = """
local alive, count, tier = {}, {}, {}
local left = #ARGV
for _, nid in ipairs(ARGV) do alive[nid] = true; count[nid] = 0; tier[nid] = 0 end
for _, key in ipairs(KEYS) do
  if left == 0 then break end
  local h = redis.call('HGETALL', key)
  local held = {}
  for i = 1, #h, 2 do held[h[i]] = tonumber(h[i + 1]) end
  for nid, _ in pairs(alive) do
    local t = held[nid]
    if t then
      count[nid] = count[nid] + 1
      if t > tier[nid] then tier[nid] = t end
    else
      alive[nid] = nil
      left = left - 1
    end
  end
end
local out = {}
for _, nid in ipairs(ARGV) do
  if count[nid] > 0 then
    out[#out + 1] = nid; out[#out + 1] = count[nid]; out[#out + 1] = tier[nid]
  end
end
return out
"""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    role: str  # "prefill" | "decode"
    grpc_address: str  # host:port of the node's gRPC server
    fingerprint: str
    block_size: int
    num_blocks: int
    # load, as of the last heartbeat
    waiting: int = 0
    running: int = 0
    running_tokens: int = 0
    free_blocks: int = 0
    kv_usage: float = 0.0
    updated_at: float = 0.0
    # index bookkeeping: last applied event batch and when the node published it (-1/0: none)
    index_seq: int = -1
    event_at: float = 0.0

    @staticmethod
    def from_hash(node_id: str, h: Mapping[bytes, bytes]) -> "NodeInfo":
        g = {k.decode(): v.decode() for k, v in h.items()}
        return NodeInfo(
            node_id=node_id,
            role=g["role"],
            grpc_address=g["grpc"],
            fingerprint=g["fingerprint"],
            block_size=int(g["block_size"]),
            num_blocks=int(g["num_blocks"]),
            waiting=int(g.get("waiting", 0)),
            running=int(g.get("running", 0)),
            running_tokens=int(g.get("running_tokens", 0)),
            free_blocks=int(g.get("free_blocks", 0)),
            kv_usage=float(g.get("kv_usage", 0.0)),
            updated_at=float(g.get("updated_at", 0.0)),
            index_seq=int(g.get("seq", -1)),
            event_at=float(g.get("event_at", 0.0)),
        )


@dataclass(frozen=True, slots=True)
class StepReport:
    """One unit of prefill work a node measured: ``new_tokens`` computed over a context of
    ``context_tokens`` (cached + new) in ``seconds``. The router fits its cost model on these."""

    new_tokens: int
    context_tokens: int
    seconds: float


class NodePublisher:
    """Node side: register, heartbeat load (the lease), publish block events and step reports.

    Not thread-safe: one publisher thread per node owns it (``seq`` is its state)."""

    def __init__(self, client: redis.Redis, info: NodeInfo, ns: str = DEFAULT_NS, lease_s: float = 3.0,
                 tier: int = TIER_DEVICE) -> None:
        self.r = client
        self.info = info
        self.ns = ns
        self.lease_ms = int(lease_s * 1000)
        self.tier = tier
        self.seq = 0  # last event batch the index acknowledged
        self._key = node_key(ns, info.node_id)
        self._apply = client.register_script(_APPLY_EVENTS)
        self._resync = client.register_script(_RESYNC)

    def _identity(self) -> dict:
        i = self.info
        return {"role": i.role, "grpc": i.grpc_address, "fingerprint": i.fingerprint,
                "block_size": i.block_size, "num_blocks": i.num_blocks}

    def register(self) -> None:
        """Announce a fresh node: no blocks, sequence 0."""
        p = self.r.pipeline(transaction=True)
        # A restarted node reuses no state: whatever it published before is gone with its pool.
        self._drop_blocks(p)
        p.hset(self._key, mapping={**self._identity(), "updated_at": time.time(), "seq": 0,
                                   "event_at": time.time()})
        p.pexpire(self._key, self.lease_ms)
        p.sadd(nodes_key(self.ns), self.info.node_id)
        p.execute()
        self.seq = 0

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

    def publish(self, stored: Iterable[int] = (), removed: Iterable[int] = (), cleared: bool = False) -> bool:
        """Apply one batch of block events (chained hashes) in one round trip, as batch
        ``seq + 1``. Returns False on a gap (nothing applied): call ``resync``."""
        stored, removed = list(stored), list(removed)
        if not (stored or removed or cleared):
            return True
        nid = self.info.node_id
        args = [self.ns, nid, self.seq + 1, time.time(), "1" if cleared else "0", len(removed),
                *[f"{h:016x}" for h in removed], self.tier, *[f"{h:016x}" for h in stored]]
        ok, _ = self._apply(keys=[self._key, node_blocks_key(self.ns, nid)], args=args)
        if ok:
            self.seq += 1
        return bool(ok)

    def resync(self, held: Iterable[int]) -> None:
        """Replace every entry of this node with ``held`` (its snapshot), re-registering it if
        its lease had lapsed; one round trip plus the registry refresh."""
        nid = self.info.node_id
        p = self.r.pipeline(transaction=True)
        p.hset(self._key, mapping={**self._identity(), "updated_at": time.time()})
        p.pexpire(self._key, self.lease_ms)
        p.sadd(nodes_key(self.ns), nid)
        p.execute()
        seq = self.seq + 1
        self._resync(keys=[self._key, node_blocks_key(self.ns, nid)],
                     args=[self.ns, nid, seq, time.time(), self.tier, *[f"{h:016x}" for h in held]])
        self.seq = seq

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


def drop_node_blocks(r: redis.Redis, p, ns: str, node_id: str) -> None:
    """Queue on pipeline ``p`` the removal of every index entry of ``node_id``."""
    hashes = r.smembers(node_blocks_key(ns, node_id))
    for hx in hashes:
        p.hdel(f"{ns}:blk:{hx.decode()}", node_id)
    p.delete(node_blocks_key(ns, node_id))


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    nodes: dict[str, NodeInfo]  # live nodes by id
    matched_blocks: dict[str, int]  # node id -> leading blocks of the prompt it holds


class IndexReader:
    """Router side: live nodes and, per node, how many leading prompt blocks it holds.

    ``round_trips`` counts every Redis round trip this reader made (``match`` makes one)."""

    def __init__(self, client: redis.Redis, ns: str = DEFAULT_NS) -> None:
        self.r = client
        self.ns = ns
        self.round_trips = 0
        self._match = client.register_script(_MATCH)
        self.last_tiers: dict[str, int] = {}  # worst tier of each node's match, from the last match

    def live_nodes(self) -> dict[str, NodeInfo]:
        ids = sorted(x.decode() for x in self.r.smembers(nodes_key(self.ns)))
        p = self.r.pipeline(transaction=False)
        for nid in ids:
            p.hgetall(node_key(self.ns, nid))
        self.round_trips += 2
        return {nid: NodeInfo.from_hash(nid, h) for nid, h in zip(ids, p.execute()) if h}

    def match(self, block_hashes: Sequence[int], node_ids: Sequence[str]) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` each of ``node_ids`` holds: one script call, one
        round trip, whatever the number of blocks."""
        out = {n: 0 for n in node_ids}
        self.last_tiers = {}
        if not block_hashes or not node_ids:
            return out
        flat = self._match(keys=[block_key(self.ns, h) for h in block_hashes], args=list(node_ids))
        self.round_trips += 1
        for i in range(0, len(flat), 3):
            nid = flat[i].decode()
            out[nid] = int(flat[i + 1])
            self.last_tiers[nid] = int(flat[i + 2])
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
        dead = [nid for nid in ids if not self.r.exists(node_key(self.ns, nid))]
        for nid in dead:
            p = self.r.pipeline(transaction=True)
            drop_node_blocks(self.r, p, self.ns, nid)
            p.delete(steps_key(self.ns, nid))
            p.srem(nodes_key(self.ns), nid)
            p.execute()
        return dead


def index_freshness(nodes: Iterable[NodeInfo], now: float) -> dict[str, float]:
    """Age in seconds of the newest applied event batch, per node (its clock vs ``now``).
    A node that published nothing since registering shows the age of its registration."""
    return {n.node_id: max(0.0, now - n.event_at) for n in nodes if n.event_at > 0}
