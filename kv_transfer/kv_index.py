"""The global KV-block index and node registry in Redis: key schema, node side, reader side.

Torch-free and Ray-free: nodes publish through ``NodePublisher``; the router reads through
``IndexReader``. The index is a hint: a stale entry costs a cache miss on the chosen node
(which verifies tokens before reusing a block), never a wrong answer.

Key schema (``ns`` defaults to ``pdserve``; several clusters can share one Redis)::

    {ns}:nodes                  SET   node ids ever registered (readers prune dead ones)
    {ns}:node:{node_id}         HASH  role, grpc address, model fingerprint, block size,
                                      num_blocks + load (waiting, running, running_tokens,
                                      free_blocks, kv_usage, updated_at); PEXPIRE = lease
    {ns}:blk:{hash:016x}        SET   node ids holding the KV block with this chained hash
    {ns}:nodeblk:{node_id}      SET   hashes a node has published (cleanup and resync)

A node's lease is its HASH's TTL, refreshed by every heartbeat: when a node dies the HASH
expires within ``lease_s`` and readers stop seeing it, so it stops receiving work; its block
entries are ignored from then on (and removed by ``prune_dead``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import redis

DEFAULT_NS = "pdserve"
LOAD_FIELDS = ("waiting", "running", "running_tokens", "free_blocks", "num_blocks", "kv_usage")


def node_key(ns: str, node_id: str) -> str:
    return f"{ns}:node:{node_id}"


def nodes_key(ns: str) -> str:
    return f"{ns}:nodes"


def block_key(ns: str, block_hash: int) -> str:
    return f"{ns}:blk:{block_hash:016x}"


def node_blocks_key(ns: str, node_id: str) -> str:
    return f"{ns}:nodeblk:{node_id}"


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
        )


class NodePublisher:
    """Node side: register, heartbeat load (the lease) and publish block events."""

    def __init__(self, client: redis.Redis, info: NodeInfo, ns: str = DEFAULT_NS, lease_s: float = 3.0) -> None:
        self.r = client
        self.info = info
        self.ns = ns
        self.lease_ms = int(lease_s * 1000)
        self._key = node_key(ns, info.node_id)

    def register(self) -> None:
        i = self.info
        p = self.r.pipeline(transaction=True)
        # A restarted node reuses no state: whatever it published before is gone with its pool.
        self._drop_blocks(p)
        p.hset(self._key, mapping={
            "role": i.role, "grpc": i.grpc_address, "fingerprint": i.fingerprint,
            "block_size": i.block_size, "num_blocks": i.num_blocks, "updated_at": time.time(),
        })
        p.pexpire(self._key, self.lease_ms)
        p.sadd(nodes_key(self.ns), i.node_id)
        p.execute()

    def heartbeat(self, load: Mapping[str, float | int]) -> None:
        """Refresh the lease and the load figures in one round trip."""
        fields = {k: load[k] for k in LOAD_FIELDS if k in load}
        fields["updated_at"] = time.time()
        p = self.r.pipeline(transaction=True)
        # Re-create identity fields too: a heartbeat after an expiry re-registers the node.
        i = self.info
        p.hset(self._key, mapping={**fields, "role": i.role, "grpc": i.grpc_address,
                                   "fingerprint": i.fingerprint, "block_size": i.block_size,
                                   "num_blocks": i.num_blocks})
        p.pexpire(self._key, self.lease_ms)
        p.sadd(nodes_key(self.ns), i.node_id)
        p.execute()

    def publish(self, stored: Iterable[int] = (), removed: Iterable[int] = (), cleared: bool = False) -> None:
        """Apply block events in one round trip: stored/removed are chained block hashes."""
        stored, removed = list(stored), list(removed)
        if not (stored or removed or cleared):
            return
        p = self.r.pipeline(transaction=False)
        if cleared:
            self._drop_blocks(p)
        nid = self.info.node_id
        for h in removed:
            p.srem(block_key(self.ns, h), nid)
        for h in stored:
            p.sadd(block_key(self.ns, h), nid)
        if removed:
            p.srem(node_blocks_key(self.ns, nid), *[f"{h:016x}" for h in removed])
        if stored:
            p.sadd(node_blocks_key(self.ns, nid), *[f"{h:016x}" for h in stored])
        p.execute()

    def deregister(self) -> None:
        p = self.r.pipeline(transaction=True)
        self._drop_blocks(p)
        p.delete(self._key)
        p.srem(nodes_key(self.ns), self.info.node_id)
        p.execute()

    def _drop_blocks(self, p) -> None:
        drop_node_blocks(self.r, p, self.ns, self.info.node_id)


def drop_node_blocks(r: redis.Redis, p, ns: str, node_id: str) -> None:
    """Queue on pipeline ``p`` the removal of every index entry of ``node_id``."""
    hashes = r.smembers(node_blocks_key(ns, node_id))
    for hx in hashes:
        p.srem(f"{ns}:blk:{hx.decode()}", node_id)
    p.delete(node_blocks_key(ns, node_id))


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    nodes: dict[str, NodeInfo]  # live nodes by id
    matched_blocks: dict[str, int]  # node id -> leading blocks of the prompt it holds


class IndexReader:
    """Router side: live nodes and, per node, how many leading prompt blocks it holds."""

    def __init__(self, client: redis.Redis, ns: str = DEFAULT_NS) -> None:
        self.r = client
        self.ns = ns
        self.round_trips = 0

    def live_nodes(self) -> dict[str, NodeInfo]:
        ids = sorted(x.decode() for x in self.r.smembers(nodes_key(self.ns)))
        p = self.r.pipeline(transaction=False)
        for nid in ids:
            p.hgetall(node_key(self.ns, nid))
        self.round_trips += 2
        return {nid: NodeInfo.from_hash(nid, h) for nid, h in zip(ids, p.execute()) if h}

    def match(self, block_hashes: Sequence[int], node_ids: Sequence[str]) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` each node holds, in one pipelined round trip."""
        if not block_hashes:
            return {n: 0 for n in node_ids}
        p = self.r.pipeline(transaction=False)
        for h in block_hashes:
            p.smembers(block_key(self.ns, h))
        holders = p.execute()
        self.round_trips += 1
        out = {}
        for nid in node_ids:
            b = nid.encode()
            n = 0
            for s in holders:
                if b not in s:
                    break
                n += 1
            out[nid] = n
        return out

    def prune_dead(self) -> list[str]:
        """Forget nodes whose lease expired and remove their index entries."""
        ids = [x.decode() for x in self.r.smembers(nodes_key(self.ns))]
        dead = [nid for nid in ids if not self.r.exists(node_key(self.ns, nid))]
        for nid in dead:
            p = self.r.pipeline(transaction=True)
            drop_node_blocks(self.r, p, self.ns, nid)
            p.srem(nodes_key(self.ns), nid)
            p.execute()
        return dead
