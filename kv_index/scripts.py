"""The index's server-side scripts (the key layout they work on: kv_index/schema.py).

Every script gets the namespace's hash tag (``schema.tag``) as ARGV[1] and builds bucket keys
from it (``{ns}:b:{bucket}``): on Redis Cluster those keys share the slot of the declared
ones. Hashes travel 8 bytes each, big-endian (``schema.pack_hashes``): the first 12 bits pick
the bucket, the last 7 bytes are the field. A value is a string of (slot, mask) byte pairs.
"""
from __future__ import annotations

from kv_index.schema import BUCKETS, EVENT_STREAM_MAXLEN, INDEX_TTL_S, MAX_SLOTS

# Helpers every writing script shares.
#   KEYS: node HASH, slots HASH, events stream, events count (then script-specific ones)
_COMMON = """
local P = ARGV[1]
local TTL_MS = %d
local function append_event(nid, ...)
  local g = redis.call('INCR', KEYS[4])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', %d, '*', 'g', g, 'n', nid, ...)
end
local function bkey(blob, j)
  local b1, b2 = string.byte(blob, j, j + 1)
  return P .. ':b:' .. (b1 * 16 + math.floor(b2 / 16))
end
-- The mask of slot byte s in value v, and where its pair starts (nil: not there).
local function find(v, s)
  for i = 1, #v, 2 do
    if string.sub(v, i, i) == s then return string.byte(v, i + 1), i end
  end
  return 0, nil
end
-- Slot s's mask in field f of key becomes m (0: its pair goes; the field too, when empty).
local function put(key, f, v, at, s, m)
  local nv
  if at then
    if m == 0 then nv = string.sub(v, 1, at - 1) .. string.sub(v, at + 2)
    else nv = string.sub(v, 1, at) .. string.char(m) .. string.sub(v, at + 2) end
  else
    nv = (v or '') .. s .. string.char(m)
  end
  if nv == '' then redis.call('HDEL', key, f) else redis.call('HSET', key, f, nv) end
end
-- Every pair of slot s removed from every bucket; returns how many.
local function drop_all(s)
  local n = 0
  for b = 0, %d do
    local key = P .. ':b:' .. b
    local h = redis.call('HGETALL', key)
    for i = 1, #h, 2 do
      local v = h[i + 1]
      if string.find(v, s, 1, true) then
        local m, at = find(v, s)
        if at then put(key, h[i], v, at, s, 0); n = n + 1 end
      end
    end
  end
  return n
end
""" % (INDEX_TTL_S * 1000, EVENT_STREAM_MAXLEN, BUCKETS - 1)

# Refreshes a node's lease (``lease_until`` = Redis's TIME + ARGV[2] ms) and registry fields.
#   KEYS: node HASH, nodes SET;  ARGV: node_id, lease_ms, field, value, ...
#   -> 1 if the node's index state is intact (its seq is there), else 0
LEASE = """
local intact = redis.call('HEXISTS', KEYS[1], 'seq')
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
if #ARGV > 2 then redis.call('HSET', KEYS[1], unpack(ARGV, 3)) end
redis.call('HSET', KEYS[1], 'lease_until', now + tonumber(ARGV[2]))
redis.call('SADD', KEYS[2], ARGV[1])
return intact
"""

# Applies one event batch iff it follows the last applied one.
#   KEYS: node HASH, slots HASH, events stream, events count
#   ARGV: tag, node_id, seq, event_at, cleared (0/1), then groups "-" | "+", tier, hashes
#         (removals first, then stores)
#   -> {1, seq} applied; {0, last_seq or -1} gap (nothing applied)
# A group sets or clears the tier's bit in each block's mask for this node. The node HASH or
# its slot missing (pruned, Redis restarted) is a gap too, and so is a lapsed lease (a router
# may prune it at any moment): only a full snapshot restores it.
APPLY_EVENTS = _COMMON + """
local last = redis.call('HGET', KEYS[1], 'seq')
local seq = tonumber(ARGV[3])
local slot = redis.call('HGET', KEYS[2], ARGV[2])
local t = redis.call('TIME')
local lapsed = tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0') <= t[1] * 1000 + math.floor(t[2] / 1000)
if (not last) or (not slot) or lapsed or tonumber(last) ~= seq - 1 then
  return {0, last and tonumber(last) or -1}
end
local s = string.char(tonumber(slot))
local delta = 0
if ARGV[5] == '1' then
  drop_all(s)
  redis.call('HSET', KEYS[1], 'held', 0)
end
local touched, groups = {}, {}
for i = 6, #ARGV, 3 do
  local op, bit, blob = ARGV[i], 2 ^ tonumber(ARGV[i + 1]), ARGV[i + 2]
  groups[#groups + 1] = op .. ARGV[i + 1] .. struct.pack('>I4', #blob / 8) .. blob
  for j = 1, #blob, 8 do
    local key, f = bkey(blob, j), string.sub(blob, j + 1, j + 7)
    local v = redis.call('HGET', key, f)
    local m, at = 0, nil
    if v then m, at = find(v, s) end
    local has = m %% (2 * bit) >= bit
    if op == '+' then
      if not has then
        put(key, f, v, at, s, m + bit)
        touched[key] = true
        if m == 0 then delta = delta + 1 end
      end
    elseif has then
      put(key, f, v, at, s, m - bit)
      if m == bit then delta = delta - 1 end
    end
  end
end
for key in pairs(touched) do redis.call('PEXPIRE', key, TTL_MS) end
if delta ~= 0 then redis.call('HINCRBY', KEYS[1], 'held', delta) end
redis.call('HSET', KEYS[1], 'seq', seq, 'event_at', ARGV[4])
append_event(ARGV[2], 'k', 'a', 's', seq, 'c', ARGV[5], 'e', table.concat(groups))
return {1, seq}
""".replace("%%", "%")

# Replaces all of a node's entries with its snapshot and sets its sequence number; gives the
# node a slot if it has none.
#   KEYS: node HASH, slots HASH, events stream, events count
#   ARGV: tag, node_id, seq, event_at, then groups mask, hashes
#   -> the number of blocks now held; an error naming the limit when every slot is taken
RESYNC = _COMMON + """
local nid = ARGV[2]
local slot = redis.call('HGET', KEYS[2], nid)
if slot then
  if redis.call('HGET', KEYS[1], 'held') ~= '0' then drop_all(string.char(tonumber(slot))) end
else
  local used = {}
  for _, v in ipairs(redis.call('HVALS', KEYS[2])) do used[tonumber(v)] = true end
  for i = 1, %d do
    if not used[i] then slot = i; break end
  end
  if not slot then
    return redis.error_reply('pdserve index full: %d nodes already hold an index slot (the most one ' ..
      'namespace indexes); node ' .. nid .. ' refused: let dead nodes be pruned, or use another namespace')
  end
  redis.call('HSET', KEYS[2], nid, slot)
end
local s = string.char(tonumber(slot))
local total, touched = 0, {}
for i = 5, #ARGV, 2 do
  local mask, blob = tonumber(ARGV[i]), ARGV[i + 1]
  for j = 1, #blob, 8 do
    local key, f = bkey(blob, j), string.sub(blob, j + 1, j + 7)
    local v = redis.call('HGET', key, f)
    local m, at = 0, nil
    if v then m, at = find(v, s) end
    put(key, f, v, at, s, mask)
    touched[key] = true
    if m == 0 then total = total + 1 end
  end
end
for key in pairs(touched) do redis.call('PEXPIRE', key, TTL_MS) end
redis.call('HSET', KEYS[1], 'seq', ARGV[3], 'event_at', ARGV[4], 'held', total)
-- Not the snapshot (a node's whole cache): a reader reads the entries themselves when t > 0.
append_event(nid, 'k', 'r', 's', ARGV[3], 't', total)
return total
""" % (MAX_SLOTS, MAX_SLOTS)

# Removes a node from the index: entries, slot, registry entry, step stream (deregistered, or
# pruned: ARGV[3] = 1 drops it only if its lease has lapsed, checked in the same call).
#   KEYS: node HASH, slots HASH, events stream, events count, nodes SET, steps STREAM
#   ARGV: tag, node_id, only_if_dead  -> entries removed, -1: alive, nothing done
DROP_NODE = _COMMON + """
local nid = ARGV[2]
if ARGV[3] == '1' then
  local t = redis.call('TIME')
  local lease = tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0')
  if lease > t[1] * 1000 + math.floor(t[2] / 1000) then return -1 end
end
local slot = redis.call('HGET', KEYS[2], nid)
local n = 0
if slot then
  if redis.call('HGET', KEYS[1], 'held') ~= '0' then n = drop_all(string.char(tonumber(slot))) end
  redis.call('HDEL', KEYS[2], nid)
end
redis.call('DEL', KEYS[1], KEYS[6])
redis.call('SREM', KEYS[5], nid)
append_event(nid, 'k', 'd')
return n
"""

# Leading blocks held per candidate node, walking the chain in Redis, each block counted in
# the fastest tier the node holds it in.
#   KEYS: slots HASH;  ARGV: tag, n, n candidate node ids, the prompt's hashes
#   -> flat {node_id, blocks, host, disk, ...} for nodes with a match (host / disk: of those
#      blocks, held there and not in a faster tier), in candidate order
# The walk stops at the first block no remaining candidate holds, so a miss costs one HGET.
MATCH = """
local P, n = ARGV[1], tonumber(ARGV[2])
local blob = ARGV[n + 3]
local slots = redis.call('HMGET', KEYS[1], unpack(ARGV, 3, n + 2))
local alive, k, count, host, disk, of = {}, 0, {}, {}, {}, {}
for i = 1, n do
  if slots[i] then
    local c = string.char(tonumber(slots[i]))
    k = k + 1; alive[k] = c; of[i] = c; count[c] = 0; host[c] = 0; disk[c] = 0
  end
end
for j = 1, #blob, 8 do
  if k == 0 then break end
  local b1, b2 = string.byte(blob, j, j + 1)
  local v = redis.call('HGET', P .. ':b:' .. (b1 * 16 + math.floor(b2 / 16)), string.sub(blob, j + 1, j + 7))
  if not v then break end
  local m = {}
  for i = 1, #v, 2 do m[string.sub(v, i, i)] = string.byte(v, i + 1) end
  local kk = 0
  for i = 1, k do
    local c = alive[i]
    local x = m[c]
    if x then
      kk = kk + 1; alive[kk] = c; count[c] = count[c] + 1
      if x % 2 == 0 then
        if x % 4 >= 2 then host[c] = host[c] + 1 else disk[c] = disk[c] + 1 end
      end
    end
  end
  k = kk
end
local out = {}
for i = 1, n do
  local c = of[i]
  if c and count[c] > 0 then
    out[#out + 1] = ARGV[i + 2]; out[#out + 1] = count[c]; out[#out + 1] = host[c]; out[#out + 1] = disk[c]
  end
end
return out
"""

# One node's entries and seq, and the event number they are as of, in one atomic call.
#   KEYS: node HASH, slots HASH, events count;  ARGV: tag, node_id
#   -> {seq or -1, events count, hash (8 bytes), mask, hash, mask, ...}
SNAPSHOT_NODE = """
local out = {redis.call('HGET', KEYS[1], 'seq') or '-1', redis.call('GET', KEYS[3]) or '0'}
local slot = redis.call('HGET', KEYS[2], ARGV[2])
if (not slot) or redis.call('HGET', KEYS[1], 'held') == '0' then return out end
local s = string.char(tonumber(slot))
for b = 0, %d do
  local h = redis.call('HGETALL', ARGV[1] .. ':b:' .. b)
  local head = string.char(math.floor(b / 16))
  for i = 1, #h, 2 do
    local v = h[i + 1]
    if string.find(v, s, 1, true) then
      for k = 1, #v, 2 do
        if string.sub(v, k, k) == s then
          out[#out + 1] = head .. h[i]; out[#out + 1] = string.byte(v, k + 1)
          break
        end
      end
    end
  end
end
return out
""" % (BUCKETS - 1)

# Every node's entries, seq and slot, and the event number they are as of, in one atomic call
# (a router's full resync: one scan for all nodes, not one per node).
#   KEYS: slots HASH, events count, nodes SET;  ARGV: tag
#   -> {events count, {node_id, slot, seq or -1, ...}, {bucket, field, value, field, value, ...}, ...}
SNAPSHOT_ALL = """
local nodes = {}
local ids = redis.call('SMEMBERS', KEYS[3])
local slots = redis.call('HGETALL', KEYS[1])
local seen = {}
for i = 1, #slots, 2 do seen[slots[i]] = slots[i + 1] end
for _, nid in ipairs(ids) do if not seen[nid] then seen[nid] = '0' end end
for nid, slot in pairs(seen) do
  nodes[#nodes + 1] = nid; nodes[#nodes + 1] = slot
  nodes[#nodes + 1] = redis.call('HGET', ARGV[1] .. ':node:' .. nid, 'seq') or '-1'
end
local out = {redis.call('GET', KEYS[2]) or '0', nodes}
for b = 0, %d do
  local h = redis.call('HGETALL', ARGV[1] .. ':b:' .. b)
  if #h > 0 then
    table.insert(h, 1, b)
    out[#out + 1] = h
  end
end
return out
""" % (BUCKETS - 1)

# The registry in one call: Redis's clock and every node's HASH.
#   KEYS: nodes SET;  ARGV: tag  -> {now_ms, node_id, {field, value, ...}, ...}
LIVE_NODES = """
local t = redis.call('TIME')
local out = {t[1] * 1000 + math.floor(t[2] / 1000)}
for _, nid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  out[#out + 1] = nid
  out[#out + 1] = redis.call('HGETALL', ARGV[1] .. ':node:' .. nid)
end
return out
"""
