"""Router replicas that share one cluster: each publishes its own in-flight prefill load per
node to Redis and merges the others' into the backlog its placement and admission see.

A replica's ledger (router/node_view.py ``PrefillLedger``) knows only the requests it sent
itself. Two replicas behind one port (``pdserve up --routers N``: SO_REUSEPORT, the kernel
spreads the connections) would each see an idle node where the other has just queued seconds
of prefill there, and both pile onto it: the nodes' heartbeats do not help, because a node in
the ledger is judged by the ledger alone (its predicted seconds beat a heartbeat's token count).
So every ``every_s`` (the node view's refresh) each replica writes its ledger and reads the
others'::

    {ns}:routers                ZSET   replica id -> when its record expires (unix seconds):
                                       the live replicas (`pdserve status`), pruned by readers
    {ns}:routers:load:{id}      HASH   at (unix seconds), address, pid, inflight (requests),
                                       and n:{node_id} -> predicted prefill seconds in flight
                                       there; PEXPIRE ttl_s (a few refreshes)

A killed replica's record lapses within ``ttl_s``, and its load with it. The others' figures are
up to two refreshes old: between publishes a replica sees its own requests at once and the
others' as of their last write (the staleness `pdserve bench router --routers N` replays).
A Redis that does not answer keeps the last figures read for ``ttl_s``, then none: placement
goes on with this replica's own ledger, as a single router does.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from kv_index.schema import tag
from router.node_view import PrefillLedger
from telemetry.log_limit import RateLimitedLog

log = logging.getLogger(__name__)
_outage_log = RateLimitedLog(log)
NODE_PREFIX = "n:"


def replicas_key(ns: str) -> str:
    return f"{tag(ns)}:routers"


def load_key(ns: str, replica_id: str) -> str:
    return f"{tag(ns)}:routers:load:{replica_id}"


def new_replica_id() -> str:
    """Unique per process: host, pid and a random tail (a restarted replica is a new one)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def read_replicas(client, ns: str, now: float | None = None, prune: bool = True) -> dict[str, dict]:
    """Every live replica's record: id -> {"at", "address", "pid", "inflight", "load": {node: s}}.
    ``prune``: expired members of the set are removed (a replica killed with SIGKILL never
    removes its own; `pdserve status` only reads). Raises redis errors."""
    now = time.time() if now is None else now
    zkey = replicas_key(ns)
    if prune:
        client.zremrangebyscore(zkey, "-inf", now)
    ids = [m.decode() if isinstance(m, bytes) else m for m in client.zrangebyscore(zkey, now, "+inf")]
    if not ids:
        return {}
    pipe = client.pipeline(transaction=False)
    for rid in ids:
        pipe.hgetall(load_key(ns, rid))
    out = {}
    for rid, h in zip(ids, pipe.execute()):
        if h:  # the hash lapsed before the set member did: gone
            out[rid] = parse_record(h)
    return out


def parse_record(h: dict) -> dict:
    g = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
         for k, v in h.items()}
    load = {k[len(NODE_PREFIX):]: float(v) for k, v in g.items() if k.startswith(NODE_PREFIX)}
    return {"at": float(g.get("at", 0.0)), "address": g.get("address", ""), "pid": int(g.get("pid", 0) or 0),
            "inflight": int(g.get("inflight", 0) or 0), "load": load}


def merge_others(records: dict[str, dict], own_id: str) -> dict[str, float]:
    """Node id -> the summed backlog seconds of every replica but ``own_id``."""
    total: dict[str, float] = {}
    for rid, rec in records.items():
        if rid == own_id:
            continue
        for nid, s in rec["load"].items():
            total[nid] = total.get(nid, 0.0) + s
    return total


class LoadShare:
    """Publishes ``ledger``'s own backlog under ``replica_id`` and feeds the others' into it
    (``ledger.set_others``), every ``every_s`` on a thread of its own. ``inflight``: this
    replica's requests in flight, for `pdserve status`."""

    def __init__(self, client, ns: str, replica_id: str, ledger: PrefillLedger, every_s: float,
                 address: str = "", inflight: Callable[[], int] = lambda: 0, ttl_s: float | None = None) -> None:
        self.client, self.ns, self.replica_id, self.ledger = client, ns, replica_id, ledger
        self.every_s = every_s
        # Three refreshes, at least 2 s: one slow write must not make a live replica vanish.
        self.ttl_s = ttl_s if ttl_s is not None else max(2.0, 3 * every_s)
        self.address = address
        self.inflight = inflight
        self.others: dict[str, dict] = {}  # the other replicas' records, as last read
        self._read_at = 0.0  # monotonic time of the last good read
        self._published: set[str] = set()  # the node fields of the last record written
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-load-share", daemon=True)

    def publish_once(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        key = load_key(self.ns, self.replica_id)
        fields = {"at": f"{now:.3f}", "address": self.address, "pid": str(os.getpid()),
                  "inflight": str(self.inflight())}
        nodes = {NODE_PREFIX + nid: f"{s:.6f}" for nid, s in self.ledger.own_backlog_s().items()}
        fields.update(nodes)
        gone = self._published - nodes.keys()
        # Single-key commands, no MULTI: the two keys may sit on different shards of a Redis
        # Cluster. HSET replaces the record's fields at once; a node no longer in the ledger
        # is dropped after (never delete-then-write: a reader in between would see no replica).
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(key, mapping=fields)
        if gone:
            pipe.hdel(key, *gone)
        pipe.pexpire(key, int(self.ttl_s * 1000))
        pipe.zadd(replicas_key(self.ns), {self.replica_id: now + self.ttl_s})
        pipe.execute()
        self._published = set(nodes)

    def read_once(self, now: float | None = None) -> dict[str, float]:
        records = read_replicas(self.client, self.ns, now)
        self.others = {rid: r for rid, r in records.items() if rid != self.replica_id}
        merged = merge_others(records, self.replica_id)
        self.ledger.set_others(merged)
        self._read_at = time.monotonic()
        return merged

    def step(self) -> None:
        try:
            self.publish_once()
            self.read_once()
        except Exception as e:  # noqa: BLE001 - Redis out: the last figures, then none
            _outage_log.warning("load-share", "router load sharing: Redis unreadable: %s", e)
            if time.monotonic() - self._read_at > self.ttl_s:
                self.others = {}
                self.ledger.set_others({})

    def start(self) -> None:
        self.step()  # the first figures before the first request
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        try:  # a clean stop leaves at once; a killed replica's record lapses
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(load_key(self.ns, self.replica_id))
            pipe.zrem(replicas_key(self.ns), self.replica_id)
            pipe.execute()
        except Exception as e:  # noqa: BLE001 - it lapses within ttl_s anyway
            log.info("router load record not removed: %s", e)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.step()
