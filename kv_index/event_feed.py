"""Keeps a router's ``LocalIndex`` (kv_index/local_index.py) equal to the durable copy in Redis.

Every script that changes index entries appends its event to one stream, ``{ns}:kvevents``, in
the same script call (kv_index/schema.py), numbered by ``{ns}:kvevents:n``: a batch a node
applied (``a``: its groups, in order), a node resynced (``r``: the reader reads the node's
entries, a snapshot is too big for the stream), a node's entries dropped (``d``: pruned after
its lease expired, or deregistered). One thread here reads the stream (XREAD BLOCK) and applies
each event to the copy in order, the node's seq checked as the scripts check it.

What it does when the stream cannot be followed, and why the copy ends equal anyway:

    a jump in the event number g      events were trimmed before it read them (it fell more
                                      than EVENT_STREAM_MAXLEN behind), or Redis restarted
                                      empty: resync everything (``full_sync``)
    a quiet stream whose count moved  the same, found without waiting for the next event
    a node's seq jumping, or a batch  resync that node: its entries and seq read in one script
    of a node it never saw            (``scripts.SNAPSHOT_NODE``), later events up to the snapshot's
                                      number skipped, the rest applied after it
    Redis unreachable                 keep the copy (stale) and retry; resync everything once
                                      it answers (it may have restarted)

A full resync reads the stream's position first and every node after it (one scan of the
buckets, ``scripts.SNAPSHOT_ALL``), the snapshot taken at a number no smaller: an event is in the copy exactly once whatever was appended in
between. Events of one node only touch that node's entries, so nodes resync independently.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from kv_index.client import reply_timeout
from kv_index.local_index import LocalIndex, parse_groups
from kv_index.schema import (
    DEFAULT_NS,
    events_count_key,
    events_key,
    hash_of,
    node_holdings,
    nodes_key,
    slots_key,
    tag,
    unpack_pairs,
)
from kv_index.scripts import SNAPSHOT_ALL

log = logging.getLogger(__name__)
READ_COUNT = 1024  # events per read

# Where a reader starting now continues: the last event's id and number ("0-0" when the stream
# is empty: every event appended later follows).  KEYS: stream, events count
POSITION = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local n = redis.call('GET', KEYS[2]) or '0'
if #last == 0 then return {'0-0', n} end
return {last[1][1], n}
"""


class EventFeed:
    """The reader thread of one router's local copy; the copy is ``index``.

    ``ready`` is set once the copy was first synced: until then lookups must go to Redis.
    ``on_event(node_id, kind, seq)`` is called on the thread after each applied event (the
    benchmark's staleness clock)."""

    def __init__(self, client: redis.Redis, ns: str = DEFAULT_NS, index: LocalIndex | None = None,
                 block_s: float = 0.2, retry_s: float = 0.5,
                 on_event: Callable[[str, str, int], None] | None = None) -> None:
        self.r, self.ns = client, ns
        self.index = index if index is not None else LocalIndex()
        reply_s = reply_timeout(client)
        # A blocked read must return before the client's reply timeout would call it a failure.
        self._block_ms = max(1, int(1000 * (min(block_s, reply_s / 2) if reply_s else block_s)))
        self._retry_s = retry_s
        self._on_event = on_event
        self._stream, self._count = events_key(ns), events_count_key(ns)
        self._snapshot_all = client.register_script(SNAPSHOT_ALL)
        self._position = client.register_script(POSITION)
        self._last_id = "0-0"
        self.applied = 0  # number of the last event in the copy
        self._synced: dict[str, int] = {}  # node -> event number its snapshot was taken at
        self._need_full = True
        self.ready = threading.Event()
        self.error: str | None = None  # why the copy is not being fed right now
        self.error_since: float | None = None
        self.events = self.node_resyncs = self.full_resyncs = self.gaps = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="index-event-feed", daemon=True)

    def start(self, timeout_s: float = 5.0) -> bool:
        """Start the thread; wait up to ``timeout_s`` for the first sync (True: synced)."""
        self._thread.start()
        return self.ready.wait(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def caught_up(self, timeout_s: float = 5.0) -> bool:
        """Wait until every event appended before this call is in the copy."""
        target = int(self.r.get(self._count) or 0)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.applied < target or self._need_full:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
                self.index.learn_hints()
            except Exception as e:  # Redis unreachable (or a bug): the copy is kept, stale, and resynced
                self._need_full = True  # Redis may come back empty (a restart)
                if self.error is None:
                    self.error_since = time.monotonic()
                    log.warning("index event feed: %s; the local copy is kept (stale) until it resyncs", e,
                                exc_info=not isinstance(e, redis.RedisError))
                self.error = f"index event stream unreadable: {e}"
                self._stop.wait(self._retry_s)

    def step(self) -> None:
        """Resync everything if due, then read and apply the next events (waiting up to the
        block time for some)."""
        if self._need_full:
            self.full_sync()
        got = self.r.xread({self._stream: self._last_id}, count=READ_COUNT, block=self._block_ms)
        entries = got[0][1] if got else self._quiet()
        for entry_id, fields in entries:
            if not self._entry(entry_id, fields):
                self.gaps += 1
                self._need_full = True
                break
        with self._cond:
            self._cond.notify_all()

    def _quiet(self) -> list:
        """Nothing new after a blocked read: the count and the stream read together tell a
        quiet stream from one trimmed past this reader (or a Redis that restarted empty)."""
        p = self.r.pipeline(transaction=True)
        p.get(self._count)
        p.xread({self._stream: self._last_id}, count=READ_COUNT)
        count, got = p.execute()
        entries = got[0][1] if got else []
        if not entries and int(count or 0) != self.applied:
            self.gaps += 1
            self._need_full = True
        return entries

    def full_sync(self) -> None:
        """Every node's entries from the durable copy (the stream position read first), in
        one scan of the buckets for all nodes."""
        last_id, count = self._position(keys=[self._stream, self._count])
        at, nodes, *buckets = self._snapshot_all(keys=[slots_key(self.ns), self._count, nodes_key(self.ns)],
                                                 args=[tag(self.ns)])
        at = int(at)
        by_slot: dict[int, str] = {}
        held: dict[str, dict[int, int]] = {}
        seqs: dict[str, int] = {}
        for i in range(0, len(nodes), 3):
            nid = nodes[i].decode()
            by_slot[int(nodes[i + 1])] = nid
            held[nid], seqs[nid] = {}, int(nodes[i + 2])
        for row in buckets:
            b = int(row[0])
            for j in range(1, len(row), 2):
                h = hash_of(b, row[j])
                for slot, mask in unpack_pairs(row[j + 1]):
                    nid = by_slot.get(slot)
                    if nid is not None:
                        held[nid][h] = mask
        self._synced.clear()
        for nid in sorted(set(held) | set(self.index.nodes())):
            if seqs.get(nid, -1) < 0 and not held.get(nid):
                self.index.drop_node(nid)
            else:
                self.index.replace_node(nid, held[nid], seqs[nid])
            self._synced[nid] = at
            self.node_resyncs += 1
        with self._cond:
            self._last_id, self.applied = last_id.decode(), int(count)
            self._need_full = False
            self._cond.notify_all()
        self.full_resyncs += 1
        if self.error is not None:
            log.info("index event feed: Redis answers again; the local copy is resynced")
        self.error = self.error_since = None
        self.ready.set()

    def resync_node(self, node_id: str) -> None:
        """One node's entries and seq from the durable copy."""
        seq, at, held = node_holdings(self.r, self.ns, node_id)
        if seq < 0 and not held:  # neither registered nor holding anything
            self.index.drop_node(node_id)
        else:
            self.index.replace_node(node_id, held, seq)
        self._synced[node_id] = at
        self.node_resyncs += 1

    def _entry(self, entry_id: bytes, f: dict[bytes, bytes]) -> bool:
        """Apply one event; False: it does not follow the last one (events were lost)."""
        g = int(f.get(b"g", 0))
        if g != self.applied + 1:
            return False
        nid, kind = f.get(b"n", b"").decode(), f.get(b"k", b"").decode()
        seq = int(f.get(b"s", -1))
        if g > self._synced.get(nid, 0):  # else: already in the node's snapshot
            try:
                self._apply(nid, kind, seq, f)
            except (KeyError, ValueError) as e:  # an event this reader cannot read: the entries can
                log.warning("index event %s of %s not understood (%s): resyncing the node", g, nid, e)
                self.resync_node(nid)
        self.applied, self._last_id = g, entry_id.decode()
        self.events += 1
        if self._on_event is not None:
            self._on_event(nid, kind, seq)
        return True

    def _apply(self, nid: str, kind: str, seq: int, f: dict[bytes, bytes]) -> None:
        have = self.index.node_seq(nid)
        if kind == "a":
            if have is not None and seq == have + 1:
                self.index.apply(nid, seq, f[b"c"] == b"1", parse_groups(f[b"e"]))
            elif have is None or seq > have + 1:  # a node it missed the start of, or a lost batch
                self.resync_node(nid)
            # seq <= have: in the copy already (the node's snapshot was taken after it)
        elif kind == "r":
            if int(f[b"t"]) == 0:
                self.index.replace_node(nid, {}, seq)  # a node (re)registering: nothing held
            else:
                self.resync_node(nid)
        elif kind == "d":
            self.index.drop_node(nid)
        else:
            raise ValueError(f"unknown event kind {kind!r}")
