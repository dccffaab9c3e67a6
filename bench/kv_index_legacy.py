"""The index's layout before the compact buckets (kv_index/schema.py), kept for `pdserve bench
kv-index` as its baseline: a key per block, ``{ns}:blk:{hash:016x}``, a HASH of node id ->
tier mask with the index TTL, and a SET per node of the hashes it published. Only what the
bench needs: a node's snapshot written as the old RESYNC wrote it, and the old MATCH lookup.
Never used by the serving path."""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from kv_index.nodes import NodeInfo
from kv_index.schema import INDEX_TTL_S

NS = "legacy"

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
    redis.call('PEXPIRE', ns .. ':blk:' .. ARGV[j], %d)
    redis.call('SADD', KEYS[2], ARGV[j])
  end
  total = total + n
  i = i + 2 + n
end
redis.call('HSET', KEYS[1], 'seq', ARGV[3], 'event_at', ARGV[4])
return total
""" % (INDEX_TTL_S * 1000)

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


def resync(r, info: NodeInfo, held: Mapping[int, int], lease_s: float = 3600.0) -> int:
    """The old registration (node HASH with a TTL lease, the nodes SET) and snapshot write."""
    key = f"{NS}:node:{info.node_id}"
    p = r.pipeline(transaction=True)
    p.hset(key, mapping={"role": info.role, "grpc": info.grpc_address, "fingerprint": info.fingerprint,
                         "block_size": info.block_size, "num_blocks": info.num_blocks, "updated_at": time.time()})
    p.pexpire(key, int(lease_s * 1000))
    p.sadd(f"{NS}:nodes", info.node_id)
    p.execute()
    masks: dict[int, list[str]] = {}
    for h, mask in held.items():
        if mask:
            masks.setdefault(mask, []).append(f"{h:016x}")
    args: list = [NS, info.node_id, 1, time.time()]
    for mask, hexes in masks.items():
        args += [mask, len(hexes), *hexes]
    return int(r.register_script(RESYNC)(keys=[key, f"{NS}:nodeblk:{info.node_id}"], args=args))


class LegacyReader:
    """The old ``IndexReader.match``: one MATCH call over the prompt's block keys."""

    def __init__(self, r) -> None:
        self._match = r.register_script(MATCH)

    def match(self, block_hashes: Sequence[int], node_ids: Sequence[str]) -> dict[str, int]:
        flat = self._match(keys=[f"{NS}:blk:{h:016x}" for h in block_hashes], args=list(node_ids))
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 4)}
