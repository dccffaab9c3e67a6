"""A node's background link to the Redis index: lease heartbeats and KV block events.

The engine loop hands block events over with ``submit_events`` (a queue put, never a Redis
round trip on the engine thread); this thread folds them and publishes each batch in one
pipeline, and heartbeats the load every ``heartbeat_s`` (the heartbeat is the lease).

The thread keeps the node's snapshot: the set of block hashes its published events leave
held (the same set the prefix cache holds, folded from the same events). Every batch carries
the next sequence number; when the index refuses one as a gap (a failed publish, a Redis
restart, a lease that lapsed and was pruned) or a heartbeat finds the node's entry gone, the
thread replaces the node's entries with that snapshot in one script call, so the index
recovers without the node dropping its cache.

Redis trouble never stops serving: the index is a hint. A failed round trip is logged and the
next success starts with a resync.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping

import redis

from kv_index.events import fold_kv_events
from kv_index.nodes import StepReport
from kv_index.publisher import NodePublisher

log = logging.getLogger(__name__)


class IndexPublisherThread:
    """Registers the node at ``start``, heartbeats ``load()`` and publishes block events until
    ``stop``, which deregisters (unless told not to, as a crashed node would not)."""

    def __init__(
        self,
        publisher: NodePublisher,
        load: Callable[[], Mapping[str, float | int]],
        heartbeat_s: float,
    ) -> None:
        self.publisher = publisher
        self._load = load
        self._heartbeat_s = heartbeat_s
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._needs_resync = False
        self._held: set[int] = set()  # the snapshot; only the publisher thread touches it
        self._steps: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"index-{publisher.info.node_id}", daemon=True)
        self.num_resyncs = 0

    def start(self) -> None:
        self.publisher.register()
        self._thread.start()

    def submit_events(self, events: list) -> None:
        """Thread-safe; called by the engine loop with each batch of block events."""
        self._events.put(events)

    def submit_step(self, report: StepReport) -> None:
        """Thread-safe; a measured unit of prefill work for the router's cost model."""
        self._steps.put(report)
        self._events.put([])  # wake the thread; an empty batch publishes nothing

    def stop(self, deregister: bool = True, timeout: float = 5.0) -> None:
        self._stop.set()
        self._events.put(None)  # wake the thread
        if self._thread.is_alive():
            self._thread.join(timeout)
        if deregister:
            try:
                self.publisher.deregister()
            except redis.RedisError as err:
                # The lease still expires on its own within lease_s.
                log.warning("deregister of %s failed: %s", self.publisher.info.node_id, err)

    def _run(self) -> None:
        next_beat = time.monotonic()
        while not self._stop.is_set():
            batches = self._take_events(timeout=max(0.0, next_beat - time.monotonic()))
            try:
                if batches:
                    stored, removed, cleared = fold_kv_events(ev for b in batches for ev in b)
                    self._apply_to_snapshot(stored, removed, cleared)
                    if not self._needs_resync:
                        self._needs_resync = not self.publisher.publish(stored=stored, removed=removed,
                                                                        cleared=cleared)
                if time.monotonic() >= next_beat:
                    if not self.publisher.heartbeat(self._load()):
                        self._needs_resync = True
                    next_beat = time.monotonic() + self._heartbeat_s
                if self._needs_resync:
                    self.publisher.resync(self._held)
                    self._needs_resync = False
                    self.num_resyncs += 1
                self._flush_steps()
            except redis.RedisError as err:
                self._needs_resync = True
                log.warning("index publish for %s failed (will resync): %s",
                            self.publisher.info.node_id, err)
                next_beat = time.monotonic() + self._heartbeat_s

    def _apply_to_snapshot(self, stored: list[int], removed: list[int], cleared: bool) -> None:
        if cleared:
            self._held.clear()
        self._held.difference_update(removed)
        self._held.update(stored)

    def _flush_steps(self) -> None:
        steps = []
        while True:
            try:
                steps.append(self._steps.get_nowait())
            except queue.Empty:
                break
        if steps:
            self.publisher.report_steps(steps)  # lost on a Redis error: they are samples

    def _take_events(self, timeout: float) -> list[list]:
        """Every queued batch, waiting up to ``timeout`` for the first one."""
        batches = []
        try:
            first = self._events.get(timeout=timeout)
        except queue.Empty:
            return batches
        while True:
            if first is not None:
                batches.append(first)
            try:
                first = self._events.get_nowait()
            except queue.Empty:
                return batches
