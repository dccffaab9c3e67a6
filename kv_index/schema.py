"""The index's Redis key schema, the compact block layout and the Python side of its codecs
(the node side is publisher.py, the router side reader.py, the Lua scripts scripts.py).

Key schema (``ns`` defaults to ``pdserve``; several clusters can share one Redis). Every key of
the index and the registry starts with the hash tag ``{ns}``, so on Redis Cluster they share
one hash slot: every script's keys, declared or built inside it, sit on one master::

    {ns}:nodes                  SET    node ids ever registered (readers prune dead ones)
    {ns}:node:{node_id}         HASH   role, grpc address, metrics address (Prometheus),
                                       model fingerprint, block size, num_blocks, matmul_ms
                                       (kv_index/matmul_curve.py) + load (waiting, running, running_tokens,
                                       free_blocks, kv_usage, step_s, decode_step_s, decode_step_running,
                                       decode_step_tokens, onboard_host, onboard_disk, updated_at)
                                       + seq (last applied event batch), event_at (node clock
                                       when it was published), held (entries it holds, never
                                       less than the truth), lease_until (ms on Redis's clock)
    {ns}:slots                  HASH   node id -> its slot, 1..255 (MAX_SLOTS), while it is indexed
    {ns}:b:{bucket}             HASH   BUCKETS of them. Field: the low 7 bytes of a block's
                                       chained hash (the bucket is its top 12 bits, so the two
                                       give the whole hash back); value: one 2-byte pair per
                                       node holding it, (slot, tier mask: 1 device, 2 host,
                                       4 disk; a node may hold a device copy and a host copy
                                       at once). PEXPIRE INDEX_TTL_S (the keys Redis's
                                       volatile-lfu evicts when full; see INDEX_TTL_S)
    {ns}:kvevents               STREAM every change to the entries above, in the order applied:
                                the scripts that change them append it (so the two never
                                disagree), capped at EVENT_STREAM_MAXLEN; routers' local copies
                                follow it (kv_index/local_index.py, event_feed.py). Fields: g
                                (the event's number, from {ns}:kvevents:n), n node, k kind (a:
                                batch applied, r: node resynced, d: node's entries dropped), s
                                the node's seq, c cleared, e the batch's groups (binary:
                                ``local_index.encode_groups``), t blocks held
    {ns}:kvevents:n             STRING events ever appended (a jump in g: a reader missed some)
    {ns}:steps:{node_id}        STREAM the node's step reports (new_tokens, context_tokens,
                                       seconds), capped: the router fits its cost model on them
    {ns}:health, {ns}:health:{node_id}   a node's health record (kv_index/health.py): why it
                                       is unhealthy or down, outliving its registry entry
    {ns}:pool_targets, {ns}:pool_changes   nodes wanted per role and the pool controller's
                                       log of what it added and removed (kv_index/pool_targets.py)

Why buckets: a key per block cost about 200 bytes per (block, node) entry (the key, its
dictionary entry, its TTL entry and a hash table of holders, plus the node's SET member), 12.4
bytes per cached token. Packed into 4,096 small hashes, which Redis keeps as flat ziplists /
listpacks (up to ``hash-max-*-entries`` fields, 128 by default: about 500k distinct blocks),
a block costs its 7-byte field and 2 bytes per holder, with a few bytes of framing
(docs/bench-kv.md has the figures). A node's own entries are found by scanning the buckets for
its slot, which only a resync with a non-empty past, a clear and a drop need: rare events, one
script call each.

Why a lease field and no TTL: with TTLs the leases were volatile keys beside the buckets, and
the buckets, every lookup touching them, outranked the leases under volatile-lfu: a full
Redis evicted leases before cold blocks. ``lease_until`` on Redis's own clock (TIME inside the
scripts) has no skew between nodes and routers and cannot be evicted.
"""
from __future__ import annotations

import struct

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
# The index's bucket keys carry this TTL (renewed whenever a node stores a block in them) so
# that they, and among what grows only they, are "volatile": the Redis of `pdserve up` and of
# the chart runs maxmemory-policy volatile-lfu (deploy/redis_server.py), which when full evicts
# the least frequently used keys with a TTL and never one without (node ids and leases, slots,
# pool targets, role wishes, the plan, Ray's GCS tables). An evicted bucket costs the misses of
# its blocks (1/BUCKETS of the index), never a wrong answer. Long, as it is not meant to expire.
INDEX_TTL_S = 30 * 24 * 3600
BUCKETS = 4096  # the top 12 bits of a block's hash pick its bucket
MAX_SLOTS = 255  # nodes one namespace indexes at once: a slot is one byte of each pair
_LOW56 = (1 << 56) - 1


def tag(ns: str) -> str:
    """The hash tag every index key starts with: one Redis Cluster slot for all of them."""
    return "{" + ns + "}"


def node_key(ns: str, node_id: str) -> str:
    return f"{tag(ns)}:node:{node_id}"


def nodes_key(ns: str) -> str:
    return f"{tag(ns)}:nodes"


def slots_key(ns: str) -> str:
    return f"{tag(ns)}:slots"


def bucket_key(ns: str, bucket: int) -> str:
    return f"{tag(ns)}:b:{bucket}"


def steps_key(ns: str, node_id: str) -> str:
    return f"{tag(ns)}:steps:{node_id}"


def events_key(ns: str) -> str:
    return f"{tag(ns)}:kvevents"


def events_count_key(ns: str) -> str:
    return f"{tag(ns)}:kvevents:n"


def event_keys(ns: str) -> list[str]:
    """KEYS[3], KEYS[4] of the scripts that change entries: where they append their event."""
    return [events_key(ns), events_count_key(ns)]


def bucket_of(block_hash: int) -> int:
    return block_hash >> 52


def field_of(block_hash: int) -> bytes:
    """A block's field in its bucket: the low 7 bytes of its hash."""
    return (block_hash & _LOW56).to_bytes(7, "big")


def hash_of(bucket: int, field: bytes) -> int:
    """The block hash a bucket and field stand for (bits 52-55 are in both)."""
    return ((bucket >> 4) << 56) | int.from_bytes(field, "big")


def pack_hashes(hashes) -> bytes:
    """Hashes as the scripts take them: 8 bytes each, big-endian, concatenated."""
    hashes = list(hashes)
    return struct.pack(f">{len(hashes)}Q", *hashes)


def unpack_pairs(value: bytes) -> list[tuple[int, int]]:
    """A bucket value's (slot, mask) pairs."""
    return [(value[i], value[i + 1]) for i in range(0, len(value), 2)]


def tier_bit(tier: int) -> int:
    """A tier's bit in a block's mask (the second byte of a pair)."""
    return 1 << tier


def fastest_tier(mask: int) -> int | None:
    """The fastest tier a mask holds (None: none): device before host before disk."""
    for tier in (TIER_DEVICE, TIER_HOST, TIER_DISK):
        if mask & tier_bit(tier):
            return tier
    return None


def drop_node_blocks(r, ns: str, node_id: str, only_if_dead: bool = False) -> int:
    """Remove ``node_id`` from the index: its entries, slot, registry entry and step stream,
    in one script call that appends its event for the routers' local copies. Returns the
    entries removed (-1: ``only_if_dead`` and its lease is current, nothing done)."""
    from kv_index.scripts import DROP_NODE

    return int(r.register_script(DROP_NODE)(
        keys=[node_key(ns, node_id), slots_key(ns), *event_keys(ns), nodes_key(ns), steps_key(ns, node_id)],
        args=[tag(ns), node_id, "1" if only_if_dead else "0"]))


def node_holdings(r, ns: str, node_id: str) -> tuple[int, int, dict[int, int]]:
    """One node's entries from Redis, read atomically: (its seq or -1, the event number they
    are as of, hash -> tier mask). A scan of every bucket (one script call): for resyncs,
    `pdserve chaos` checks and tests, not the request path."""
    from kv_index.scripts import SNAPSHOT_NODE

    out = r.register_script(SNAPSHOT_NODE)(keys=[node_key(ns, node_id), slots_key(ns), events_count_key(ns)],
                                            args=[tag(ns), node_id])
    pairs = out[2:]
    held = {int.from_bytes(pairs[i], "big"): int(pairs[i + 1]) for i in range(0, len(pairs), 2)}
    return int(out[0]), int(out[1]), held


def node_entries(r, ns: str, node_ids) -> dict[str, int]:
    """Entries per node, from the registry's ``held`` counts (one pipelined round trip; an
    evicted bucket's entries still count until the node's next resync)."""
    ids = list(node_ids)
    p = r.pipeline(transaction=False)
    for nid in ids:
        p.hget(node_key(ns, nid), "held")
    return {nid: int(v or 0) for nid, v in zip(ids, p.execute())}
