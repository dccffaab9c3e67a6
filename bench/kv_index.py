"""`pdserve bench kv-index`: what the global KV-block index costs in Redis memory and lookup time,
with tiers, and what indexing coarser blocks would save.

    pdserve bench kv-index --json                              # 16 nodes x 20k blocks each
    pdserve bench kv-index --nodes 16 --blocks-per-node 100000 --json

A private redis-server (deploy/redis_server.py) is filled the way nodes fill it: each node
resyncs its snapshot in one script call (kv_index/publisher.py). Each node holds conversations:
chains of ``--chain-blocks`` blocks whose first ``--shared-blocks`` are a system prompt every
node shares. Two layouts of the same blocks, measured one after the other on an emptied Redis:

    device    every block in the device tier only (the index before tiers)
    tiered    each chain's head on the device, its middle in host memory, its tail on disk,
              the head kept in host memory too (a block in two tiers: one mask per entry)

and, for the tiered layout, the same chains indexed at coarser granularities (only every g-th
block's hash published: what indexing g x 16-token blocks would store). Per layout:

    bytes_per_entry          (Redis used_memory - empty) / (block, node) entries
    bytes_per_cached_token   the same over the tokens those entries stand for
    lookups_per_s            one client, sequential MATCH calls (kv_index/reader.py) of
                             ``--prompt-blocks``-block prompts with all nodes as candidates,
                             half of them hits of a whole chain, half a random head and a miss
    baseline_lookups_per_s   the same prompts through the lookup before tiers (HGETALL per
                             block), alternated with the MATCH calls in two rounds;
                             ``lookup_ratio`` = lookups_per_s / baseline_lookups_per_s

``entry_ratio`` = tiered / device bytes per entry (1.0: tiers cost no memory per entry).
"""
from __future__ import annotations

import argparse
import random
import time

from deploy.redis_server import RedisServer
from kv_index.client import RedisTimeouts, redis_client
from kv_index.nodes import NodeInfo
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from kv_index.schema import TIER_DEVICE, TIER_DISK, TIER_HOST, tier_bit

BLOCK_SIZE = 16
# The lookup before tiers (HGETALL of each block, every holder's field parsed), the baseline of
# ``lookups_per_s``: the tiered MATCH asks only for the candidates still matching (HMGET).
BASELINE_MATCH = """
local alive, count = {}, {}
local left = #ARGV
for _, nid in ipairs(ARGV) do alive[nid] = true; count[nid] = 0 end
for _, key in ipairs(KEYS) do
  if left == 0 then break end
  local h = redis.call('HGETALL', key)
  local held = {}
  for i = 1, #h, 2 do held[h[i]] = true end
  for nid, _ in pairs(alive) do
    if held[nid] then count[nid] = count[nid] + 1 else alive[nid] = nil; left = left - 1 end
  end
end
local out = {}
for _, nid in ipairs(ARGV) do
  if count[nid] > 0 then out[#out + 1] = nid; out[#out + 1] = count[nid] end
end
return out
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--blocks-per-node", type=int, default=20_000)
    p.add_argument("--chain-blocks", type=int, default=64, help="blocks per conversation chain")
    p.add_argument("--shared-blocks", type=int, default=8, help="leading blocks every node's chains share")
    p.add_argument("--prompt-blocks", type=int, default=64, help="blocks per looked-up prompt")
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--granularities", default="4,16", help="coarser index steps to measure (blocks per entry)")
    p.add_argument("--seed", type=int, default=0)


def chains(args, rng: random.Random) -> list[list[int]]:
    """A node's conversation chains as chained 64-bit hashes (random, as real hashes look); the
    first ``shared_blocks`` of each are the same on every node."""
    shared_rng = random.Random(args.seed - 1)
    shared = [shared_rng.getrandbits(64) for _ in range(args.shared_blocks)]
    own = args.chain_blocks - args.shared_blocks
    n = max(1, (args.blocks_per_node - args.shared_blocks) // own)
    return [shared + [rng.getrandbits(64) for _ in range(own)] for _ in range(n)]


def snapshot(node_chains: list[list[int]], tiered: bool, step: int = 1) -> dict[int, int]:
    """hash -> tier mask. Tiered: the first quarter of each chain on the device and in host
    memory, the next half in host memory, the rest on disk. ``step``: only every step-th block."""
    dev, host, disk = tier_bit(TIER_DEVICE), tier_bit(TIER_HOST), tier_bit(TIER_DISK)
    held: dict[int, int] = {}
    for chain in node_chains:
        n = len(chain)
        for i in range(step - 1, n, step):
            h = chain[i]
            if not tiered:
                mask = dev
            elif i < n // 4:
                mask = dev | host
            elif i < 3 * n // 4:
                mask = host
            else:
                mask = disk
            held[h] = held.get(h, 0) | mask
    return held


def used_memory(r) -> int:
    m = r.info("memory")
    return int(m["used_memory"]) - int(m["used_memory_startup"])


def fill(r, all_chains: list[list[list[int]]], tiered: bool, step: int) -> int:
    """Every node's snapshot resynced; returns the (block, node) entries."""
    entries = 0
    for i, node_chains in enumerate(all_chains):
        info = NodeInfo(f"n{i:02d}", "prefill", f"127.0.0.1:{1000 + i}", "fp", BLOCK_SIZE, 1 << 20)
        pub = NodePublisher(r, info, lease_s=3600)
        held = snapshot(node_chains, tiered, step)
        pub.resync(held)
        entries += len(held)
    return entries


def lookups(r, all_chains, args, rng: random.Random, step: int) -> tuple[float, float]:
    """Lookups per second of the tiered MATCH and of the baseline script, alternated (A B A B)
    over the same prompts so that a busy machine slows both alike."""
    from kv_index.schema import block_key

    reader = IndexReader(r)
    baseline = r.register_script(BASELINE_MATCH)
    ids = [f"n{i:02d}" for i in range(len(all_chains))]
    prompts = []
    for k in range(args.lookups):
        node_chains = all_chains[rng.randrange(len(all_chains))]
        chain = node_chains[rng.randrange(len(node_chains))]
        if k % 2:  # a miss after a random shared head
            prompt = chain[: rng.randrange(1, len(chain))] + [rng.getrandbits(64) for _ in range(args.prompt_blocks)]
        else:
            prompt = chain + [rng.getrandbits(64) for _ in range(args.prompt_blocks)]
        prompts.append(prompt[step - 1 :: step][: max(1, args.prompt_blocks // step)])
    def old_match(p):  # as IndexReader.match called it: keys built per lookup
        return baseline(keys=[block_key(reader.ns, h) for h in p], args=ids)

    reader.match(prompts[0], ids)  # loads the scripts
    old_match(prompts[0])
    spent = [0.0, 0.0]
    for rounds in range(2):
        for which, lookup in enumerate((lambda p: reader.match(p, ids), old_match)):
            t0 = time.perf_counter()
            for p in prompts[rounds::2]:
                lookup(p)
            spent[which] += time.perf_counter() - t0
    return len(prompts) / spent[0], len(prompts) / spent[1]


def measure(r, all_chains, args, tiered: bool, step: int = 1) -> dict:
    r.flushall()
    base = used_memory(r)
    entries = fill(r, all_chains, tiered, step)
    used = used_memory(r) - base
    rate, base = lookups(r, all_chains, args, random.Random(args.seed + 1), step)
    tokens = entries * step * BLOCK_SIZE  # an entry stands for step blocks of the chain
    return {"entries": entries, "redis_bytes": used, "bytes_per_entry": round(used / entries, 1),
            "bytes_per_cached_token": round(used / tokens, 2), "lookups_per_s": round(rate),
            "baseline_lookups_per_s": round(base), "lookup_ratio": round(rate / base, 3),
            "granularity_tokens": step * BLOCK_SIZE}


def run(args: argparse.Namespace, report) -> dict:
    rng = random.Random(args.seed)
    all_chains = [chains(args, rng) for _ in range(args.nodes)]
    out: dict = {"nodes": args.nodes, "blocks_per_node": args.blocks_per_node, "prompt_blocks": args.prompt_blocks}
    with RedisServer() as server:
        r = redis_client(server.url, RedisTimeouts(connect_s=2.0, reply_s=120.0))
        report.progress(f"device-only index: {args.nodes} nodes x {args.blocks_per_node} blocks")
        out["device"] = measure(r, all_chains, args, tiered=False)
        report.progress("tiered index (device + host copies, host, disk)")
        out["tiered"] = measure(r, all_chains, args, tiered=True)
        out["coarser"] = []
        for g in (int(x) for x in args.granularities.split(",") if x):
            report.progress(f"tiered index, every {g}th block ({g * BLOCK_SIZE}-token granularity)")
            out["coarser"].append(measure(r, all_chains, args, tiered=True, step=g))
        r.close()
    out["entry_ratio"] = round(out["tiered"]["bytes_per_entry"] / out["device"]["bytes_per_entry"], 3)
    rows = [[name, m["granularity_tokens"], m["entries"], m["redis_bytes"] / 2**20, m["bytes_per_entry"],
             m["bytes_per_cached_token"], m["lookups_per_s"], m["baseline_lookups_per_s"]]
            for name, m in [("device", out["device"]), ("tiered", out["tiered"])]
            + [(f"tiered/{m['granularity_tokens']}", m) for m in out["coarser"]]]
    report.table(["layout", "tokens/entry", "entries", "MiB", "B/entry", "B/token", "lookups/s", "baseline/s"], rows)
    return out
