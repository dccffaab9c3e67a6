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
                                       (blk keys: PEXPIRE INDEX_TTL_S, the keys Redis's
                                       volatile-lfu evicts when full; see INDEX_TTL_S)
    {ns}:kvevents               STREAM every change to the entries above, in the order applied:
                                the scripts that change them append it (so the two never
                                disagree), capped at EVENT_STREAM_MAXLEN; routers' local copies
                                follow it (kv_index/local_index.py, event_feed.py). Fields: g
                                (the event's number, from {ns}:kvevents:n), n node, k kind (a:
                                batch applied, r: node resynced, d: node's entries dropped), s
                                the node's seq, c cleared, e the batch's groups, t blocks held
    {ns}:kvevents:n             STRING events ever appended (a jump in g: a reader missed some)
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
# Index events kept for routers' local copies, all nodes together (about: MAXLEN ~). A reader
# further behind than this resyncs from the durable copy; at 1,000 batches/s, 4 s of slack.
EVENT_STREAM_MAXLEN = 4096
# The index's block keys carry this TTL (renewed whenever a node stores the block) so that they,
# and among what grows only they, are "volatile": the Redis of `pdserve up` and of the chart runs
# maxmemory-policy volatile-lfu (deploy/redis_server.py), which when full evicts the least
# frequently used keys with a TTL and never one without (node ids, pool targets, role wishes, the
# plan, Ray's GCS tables). Leases have a TTL too, but their owners touch them every heartbeat:
# among the most used keys, evicted after every colder block. A node's SET has none: hot (each
# batch adds to it) it would outrank the leases, and it stays as large as what the node holds
# (a removal drops its member even where the block's entry was evicted). Long, as it is not meant
# to expire: a block no node stored anew for 30 days loses its entry, a miss, as an eviction would.
INDEX_TTL_S = 30 * 24 * 3600
_INDEX_TTL = "local INDEX_TTL_MS = %d\n" % (INDEX_TTL_S * 1000)


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


def events_key(ns: str) -> str:
    return f"{ns}:kvevents"


def events_count_key(ns: str) -> str:
    return f"{ns}:kvevents:n"


def event_keys(ns: str) -> list[str]:
    """KEYS[3], KEYS[4] of the scripts that change entries: where they append their event."""
    return [events_key(ns), events_count_key(ns)]


# Appends the script's event to the stream (KEYS[3]) with the next number (KEYS[4]), for node
# ARGV[2]. Inside the script that changed the entries, so the stream and the index never
# disagree and the stream's order is the order Redis applied the changes in.
_APPEND_EVENT = """
local function append_event(...)
  local g = redis.call('INCR', KEYS[4])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', %d, '*', 'g', g, 'n', ARGV[2], ...)
end
""" % EVENT_STREAM_MAXLEN


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
#   KEYS: node HASH, node's block SET, then event_keys(ns)
#   ARGV: ns, node_id, seq, event_at, cleared (0/1),
#         then groups "-" | "+", tier, count, hex x count  (removals first, then stores)
#   -> {1, seq} applied; {0, last_seq or -1} gap (nothing applied)
# A group sets or clears the tier's bit in each block's mask for this node; a block whose mask
# becomes 0 leaves the node's entries. The node HASH missing (lease expired, Redis restarted)
# is a gap too: whatever the index held for the node may have been pruned, so only a full
# snapshot restores it.
APPLY_EVENTS = _APPEND_EVENT + _INDEX_TTL + """
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
        redis.call('PEXPIRE', key, INDEX_TTL_MS)
        if m == 0 then redis.call('SADD', KEYS[2], ARGV[j]) end
      end
    elseif has then
      if m == bit then
        redis.call('HDEL', key, nid)
        redis.call('SREM', KEYS[2], ARGV[j])
      else
        redis.call('HSET', key, nid, m - bit)
      end
    elseif m == 0 then
      -- The entry is gone (evicted: see INDEX_TTL_S): keep the node's SET to what it holds.
      redis.call('SREM', KEYS[2], ARGV[j])
    end
  end
  i = i + 3 + n
end
redis.call('HSET', KEYS[1], 'seq', seq, 'event_at', ARGV[4])
append_event('k', 'a', 's', seq, 'c', ARGV[5], 'e', table.concat(ARGV, ' ', 6))
return {1, seq}
"""

# Replaces all of a node's entries with its snapshot and sets its sequence number.
#   KEYS: node HASH, node's block SET, then event_keys(ns)
#   ARGV: ns, node_id, seq, event_at, then groups mask, count, hex x count
#   -> the number of blocks now held
RESYNC = _APPEND_EVENT + _INDEX_TTL + """
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
    redis.call('PEXPIRE', ns .. ':blk:' .. ARGV[j], INDEX_TTL_MS)
    redis.call('SADD', KEYS[2], ARGV[j])
  end
  total = total + n
  i = i + 2 + n
end
redis.call('HSET', KEYS[1], 'seq', ARGV[3], 'event_at', ARGV[4])
-- Not the snapshot (a node's whole cache): a reader reads the entries themselves when t > 0.
append_event('k', 'r', 's', ARGV[3], 't', total)
return total
"""

# Removes every index entry of a node (pruned: its lease expired; or deregistered).
#   KEYS: node's block SET, (unused: the event keys stay KEYS[3], KEYS[4]), then event_keys(ns)
#   ARGV: ns, node_id  -> the number of entries removed
DROP_NODE = _APPEND_EVENT + """
local hs = redis.call('SMEMBERS', KEYS[1])
for _, hx in ipairs(hs) do
  redis.call('HDEL', ARGV[1] .. ':blk:' .. hx, ARGV[2])
end
redis.call('DEL', KEYS[1])
append_event('k', 'd')
return #hs
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
    """Queue on pipeline ``p`` the removal of every index entry of ``node_id``: one script,
    which appends its event for the routers' local copies."""
    nb = node_blocks_key(ns, node_id)
    r.register_script(DROP_NODE)(keys=[nb, nb, *event_keys(ns)], args=[ns, node_id], client=p)
