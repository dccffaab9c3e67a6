"""The index's Redis key schema, its server-side scripts and the one multi-key removal both
sides need (the node side is publisher.py, the router side reader.py).

Key schema (``ns`` defaults to ``pdserve``; several clusters can share one Redis)::

    {ns}:nodes                  SET    node ids ever registered (readers prune dead ones)
    {ns}:node:{node_id}         HASH   role, grpc address, metrics address (Prometheus),
                                       model fingerprint, block size, num_blocks + load (waiting, running, running_tokens,
                                       free_blocks, kv_usage, step_s, updated_at)
                                       + seq (last applied event batch), event_at (node clock
                                       when it was published); PEXPIRE = the lease
    {ns}:blk:{hash:016x}        HASH   node id -> storage tier ("0" device, "1" host, "2" disk)
                                       of the KV block with this chained hash
    {ns}:nodeblk:{node_id}      SET    hashes a node has published (cleanup and resync)
    {ns}:steps:{node_id}        STREAM the node's step reports (new_tokens, context_tokens,
                                       seconds), capped: the router fits its cost model on them
    {ns}:health, {ns}:health:{node_id}   a node's health record (kv_index/health.py): why it
                                       is unhealthy or down, outliving its registry entry
"""
from __future__ import annotations

DEFAULT_NS = "pdserve"
# "draining": 1 while the node finishes its requests before it stops (routers skip it).
# "step_s": seconds per engine step, recent average (0: unknown).
LOAD_FIELDS = ("waiting", "running", "running_tokens", "free_blocks", "num_blocks", "kv_usage", "draining",
               "step_s")
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
APPLY_EVENTS = """
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
RESYNC = """
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
MATCH = """
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


def drop_node_blocks(r, p, ns: str, node_id: str) -> None:
    """Queue on pipeline ``p`` the removal of every index entry of ``node_id``."""
    hashes = r.smembers(node_blocks_key(ns, node_id))
    for hx in hashes:
        p.hdel(f"{ns}:blk:{hx.decode()}", node_id)
    p.delete(node_blocks_key(ns, node_id))
