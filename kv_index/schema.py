"""The index's Redis key schema, its server-side scripts and the one multi-key removal both
sides need (the node side is publisher.py, the router side reader.py).

Key schema (``ns`` defaults to ``pdserve``; several clusters can share one Redis)::

    {ns}:nodes                  SET    node ids ever registered (readers prune dead ones)
    {ns}:node:{node_id}         HASH   role, grpc address, metrics address (Prometheus),
                                       model fingerprint, block size, num_blocks, matmul_ms
                                       (kv_index/matmul_curve.py) + load (waiting, running, running_tokens,
                                       free_blocks, kv_usage, step_s, decode_step_s, decode_step_running,
                                       decode_step_tokens, onboard_host, onboard_disk, updated_at)
                                       + seq (last applied event batch), event_at (node clock
                                       when it was published); PEXPIRE = the lease
    {ns}:blk:{hash:016x}        HASH   node id -> the tiers it holds the KV block with this
                                       chained hash in, a bitmask (1 device, 2 host, 4 disk: a
                                       node may hold a device copy and a host copy at once)
    {ns}:nodeblk:{node_id}      SET    hashes a node has published (cleanup and resync)
    {ns}:steps:{node_id}        STREAM the node's step reports (new_tokens, context_tokens,
                                       seconds), capped: the router fits its cost model on them
    {ns}:health, {ns}:health:{node_id}   a node's health record (kv_index/health.py): why it
                                       is unhealthy or down, outliving its registry entry
    {ns}:pool_targets, {ns}:pool_changes   nodes wanted per role and the pool controller's
                                       log of what it added and removed (kv_index/pool_targets.py)
"""
from __future__ import annotations

DEFAULT_NS = "pdserve"
# "draining": 1 while the node finishes its requests before it stops (routers skip it).
# "step_s": seconds per engine step, recent average (0: unknown).
# "decode_step_s": the same over the steps that ran no prompt tokens (decode alone; 0: unknown),
# "decode_step_running", "decode_step_tokens": those steps' batch and context, averaged alike.
# "onboard_host", "onboard_disk": the node's KV brought back from that tier to its device since it
# started, "bytes,seconds,runs" (kv_index.nodes.OnboardTotals): routers fit onboard costs on them.
LOAD_FIELDS = ("waiting", "running", "running_tokens", "free_blocks", "num_blocks", "kv_usage", "draining",
               "step_s", "decode_step_s", "decode_step_running", "decode_step_tokens", "onboard_host", "onboard_disk")
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


def tier_bit(tier: int) -> int:
    """A tier's bit in a block's mask (``{ns}:blk:*`` values)."""
    return 1 << tier


def fastest_tier(mask: int) -> int | None:
    """The fastest tier a mask holds (None: none): device before host before disk."""
    for tier in (TIER_DEVICE, TIER_HOST, TIER_DISK):
        if mask & tier_bit(tier):
            return tier
    return None


# Applies one event batch iff it follows the last applied one.
#   KEYS: node HASH, node's block SET
#   ARGV: ns, node_id, seq, event_at, cleared (0/1),
#         then groups "-" | "+", tier, count, hex x count  (removals first, then stores)
#   -> {1, seq} applied; {0, last_seq or -1} gap (nothing applied)
# A group sets or clears the tier's bit in each block's mask for this node; a block whose mask
# becomes 0 leaves the node's entries. The node HASH missing (lease expired, Redis restarted)
# is a gap too: whatever the index held for the node may have been pruned, so only a full
# snapshot restores it.
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
local i = 6
while i <= #ARGV do
  local op, bit, n = ARGV[i], 2 ^ tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  for j = i + 3, i + 2 + n do
    local key = ns .. ':blk:' .. ARGV[j]
    local m = tonumber(redis.call('HGET', key, nid) or '0') or 0
    local has = m % (2 * bit) >= bit
    if op == '+' then
      if not has then
        redis.call('HSET', key, nid, m + bit)
        if m == 0 then redis.call('SADD', KEYS[2], ARGV[j]) end
      end
    elseif has then
      if m == bit then
        redis.call('HDEL', key, nid)
        redis.call('SREM', KEYS[2], ARGV[j])
      else
        redis.call('HSET', key, nid, m - bit)
      end
    end
  end
  i = i + 3 + n
end
redis.call('HSET', KEYS[1], 'seq', seq, 'event_at', ARGV[4])
return {1, seq}
"""

# Replaces all of a node's entries with its snapshot and sets its sequence number.
#   KEYS: node HASH, node's block SET
#   ARGV: ns, node_id, seq, event_at, then groups mask, count, hex x count
#   -> the number of blocks now held
RESYNC = """
local ns, nid = ARGV[1], ARGV[2]
for _, hx in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  redis.call('HDEL', ns .. ':blk:' .. hx, nid)
end
redis.call('DEL', KEYS[2])
local i, total = 5, 0
while i <= #ARGV do
  local mask, n = ARGV[i], tonumber(ARGV[i + 1])
  for j = i + 2, i + 1 + n do
    redis.call('HSET', ns .. ':blk:' .. ARGV[j], nid, mask)
    redis.call('SADD', KEYS[2], ARGV[j])
  end
  total = total + n
  i = i + 2 + n
end
redis.call('HSET', KEYS[1], 'seq', ARGV[3], 'event_at', ARGV[4])
return total
"""

# Leading blocks held per candidate node, walking the chain in Redis, each block counted in
# the fastest tier the node holds it in.
#   KEYS: block keys in prompt order;  ARGV: candidate node ids
#   -> flat {node_id, blocks, host, disk, ...} for nodes with a match (host / disk: of those
#      blocks, held there and not in a faster tier)
# The walk stops at the first block no remaining candidate holds, so a miss costs one HMGET;
# HMGET asks only for the nodes still matching, not every holder of a popular block.
MATCH = """
local alive, n = {}, #ARGV
local count, host, disk = {}, {}, {}
for i, nid in ipairs(ARGV) do alive[i] = nid; count[nid] = 0; host[nid] = 0; disk[nid] = 0 end
for _, key in ipairs(KEYS) do
  if n == 0 then break end
  local got = redis.call('HMGET', key, unpack(alive, 1, n))
  local k = 0
  for i = 1, n do
    local v = got[i]
    if v then
      local nid = alive[i]
      k = k + 1
      alive[k] = nid
      count[nid] = count[nid] + 1
      local m = tonumber(v)
      if m % 2 == 0 then
        if m % 4 >= 2 then host[nid] = host[nid] + 1 else disk[nid] = disk[nid] + 1 end
      end
    end
  end
  n = k
end
local out = {}
for _, nid in ipairs(ARGV) do
  if count[nid] > 0 then
    out[#out + 1] = nid; out[#out + 1] = count[nid]; out[#out + 1] = host[nid]; out[#out + 1] = disk[nid]
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
