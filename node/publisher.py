"""A node's background link to the Redis index: lease heartbeats and KV block events.

The engine loop hands block events over with ``submit_events`` (a queue put, never a Redis
round trip on the engine thread); this thread folds them and publishes each batch in one
pipeline, and heartbeats the load every ``heartbeat_s`` (the heartbeat is the lease).

The thread keeps the node's snapshot: the block hashes its published events leave held, each
with the tiers it is held in (device, host, disk: the same set the node's cache holds, folded
from the same events). Every batch carries the next sequence number; when the index refuses
one as a gap (a failed publish, a Redis restart, a lease that lapsed and was pruned) or a
heartbeat finds the node's entry gone, the thread replaces the node's entries with that
snapshot in one script call, so the index recovers without the node dropping its cache.

Redis trouble never stops serving: the index is a hint. Only this thread waits on Redis (each
round trip bounded by the client's timeouts, kv_index/client.py); the engine loop and the gRPC
handlers only queue. A failed round trip is counted and logged (rate-limited), the next heartbeat
is tried ``heartbeat_s`` later, and the next success starts with a resync: a hung Redis that
wakes (and may still run a command we gave up on) and a restarted one, from its append-only
file or empty, are repaired the same way. A Redis that does not answer at start does not stop
the node either: it registers as soon as Redis answers.

Bounded: when the engine hands over batches faster than this thread takes them (Redis slow
or down), the queued batches are folded into one net batch (the last word per block hash), so
the queue holds at most ``max_batches`` batches plus one per distinct hash; step reports (samples)
keep only the newest ``max_steps``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

import redis

from kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored, fold_kv_events_by_tier
from kv_index.nodes import NodeInfo, StepReport
from kv_index.publisher import NodePublisher
from kv_index.schema import tier_bit
from telemetry.log_limit import RateLimitedLog

log = logging.getLogger(__name__)


class IndexPublisherThread:
    """Registers the node at ``start``, heartbeats ``load()`` and publishes block events until
    ``stop``, which deregisters (unless told not to, as a crashed node would not)."""

    def __init__(
        self,
        publisher: NodePublisher,
        load: Callable[[], Mapping[str, float | int]],
        heartbeat_s: float,
        max_batches: int = 1024,
        max_steps: int = 256,
    ) -> None:
        self.publisher = publisher
        self._load = load
        self._heartbeat_s = heartbeat_s
        self._max_batches = max_batches
        self._events: deque[list | None] = deque()
        self._lock = threading.Condition()
        self._beat_now = False
        self._stop = threading.Event()
        self._needs_resync = False
        # The snapshot, block hash -> tier mask (kv_index.schema.tier_bit); only the publisher
        # thread touches it.
        self._held: dict[int, int] = {}
        self._steps: deque[StepReport] = deque(maxlen=max_steps)
        self._thread = threading.Thread(target=self._run, name=f"index-{publisher.info.node_id}", daemon=True)
        self.num_coalesced = 0  # times the queued batches were folded into one (Redis slow or down)
        self.num_resyncs = 0
        self.num_failures = 0  # Redis round trips that failed (timed out, refused)
        self.num_steps_dropped = 0  # step reports lost to a failure or to the max_steps bound
        self._failure_log = RateLimitedLog(log)  # a hung Redis fails every heartbeat
        # Called on this thread after each heartbeat (the node's desired-role check,
        # node/role_switch.py): it must be quick (one bounded Redis read) and never raise.
        self.on_beat: Callable[[], None] | None = None

    def start(self) -> None:
        """Register (an empty snapshot), then publish on the thread. Redis down or hung: the
        thread registers the node once Redis answers. Redis refusing the node (a wrong password,
        a missing permission) is a configuration error: it raises."""
        try:
            self.publisher.register()
        except (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError,
                redis.exceptions.NoPermissionError):
            raise
        except redis.RedisError as err:
            self.num_failures += 1
            self._needs_resync = True
            log.warning("%s could not register in the index yet (%s); it will once Redis answers",
                        self.publisher.info.node_id, err)
        self._thread.start()

    def counts(self) -> dict[str, int]:
        """What Redis trouble cost so far (node stats)."""
        return {"index_failures": self.num_failures, "index_resyncs": self.num_resyncs,
                "index_coalesced": self.num_coalesced, "index_steps_dropped": self.num_steps_dropped}

    def submit_events(self, events: list) -> None:
        """Thread-safe; called by the engine loop with each batch of block events."""
        with self._lock:
            self._events.append(events)
            if len(self._events) > self._max_batches:
                self._coalesce()
            self._lock.notify()

    def submit_step(self, report: StepReport) -> None:
        """Thread-safe; a measured unit of prefill work for the router's cost model."""
        with self._lock:
            if len(self._steps) == self._steps.maxlen:
                self.num_steps_dropped += 1  # the oldest goes
            self._steps.append(report)
            self._lock.notify()

    def beat_now(self) -> None:
        """Heartbeat at once (a load change routers must see now: draining)."""
        with self._lock:
            self._beat_now = True
            self._lock.notify()

    def rebind(self, info: NodeInfo, load: Callable[[], Mapping[str, float | int]]) -> None:
        """The node now serves as ``info`` says (a role switch: same node id, same engine and
        cache, a new role and address): the next heartbeat, at once, writes the new identity
        and load in one transaction. The blocks stay listed: the cache did not change."""
        with self._lock:
            self.publisher.info = info
            self._load = load
            self._beat_now = True
            self._lock.notify()

    @property
    def queued_batches(self) -> int:
        return len(self._events)

    def _coalesce(self) -> None:
        """Fold every queued batch into one with the same net effect (lock held)."""
        stop = None in self._events
        stored, removed, cleared = fold_kv_events_by_tier(ev for b in self._events if b for ev in b)
        net: list = [AllBlocksCleared()] if cleared else []
        # Per tier: a block's host copy and its device copy are separate entries.
        net.extend(BlockRemoved(tuple(hs), tier) for tier, hs in removed.items())
        net.extend(BlockStored(tuple(hs), None, (), tier) for tier, hs in stored.items())
        self._events.clear()
        self._events.append(net)
        if stop:
            self._events.append(None)
        self.num_coalesced += 1

    def stop(self, deregister: bool = True, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            self._events.append(None)  # wake the thread
            self._lock.notify()
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
                    stored, removed, cleared = fold_kv_events_by_tier(ev for b in batches for ev in b)
                    self._apply_to_snapshot(stored, removed, cleared)
                    if not self._needs_resync:
                        self._needs_resync = not self.publisher.publish(stored=stored, removed=removed,
                                                                        cleared=cleared)
                with self._lock:
                    beat_now, self._beat_now = self._beat_now, False
                if beat_now or time.monotonic() >= next_beat:
                    if not self.publisher.heartbeat(self._load()):
                        self._needs_resync = True
                    next_beat = time.monotonic() + self._heartbeat_s
                    if self.on_beat is not None:
                        self._beat_hook()
                if self._needs_resync:
                    self.publisher.resync(self._held)
                    self._needs_resync = False
                    self.num_resyncs += 1
                self._flush_steps()
            except redis.RedisError as err:
                self._needs_resync = True
                self.num_failures += 1
                self._failure_log.warning("redis", "index publish for %s failed (will resync): %s",
                                          self.publisher.info.node_id, err)
                next_beat = time.monotonic() + self._heartbeat_s

    def _beat_hook(self) -> None:
        try:
            self.on_beat()
        except Exception:  # a hook never stops the index thread (it is the node's lease)
            log.exception("the heartbeat hook of %s failed", self.publisher.info.node_id)

    def _apply_to_snapshot(self, stored: Mapping[int, list[int]], removed: Mapping[int, list[int]],
                           cleared: bool) -> None:
        """The snapshot as the index applies the batch: cleared, removals, stores, per tier."""
        held = self._held
        if cleared:
            held.clear()
        for tier, hashes in removed.items():
            keep = ~tier_bit(tier)
            for h in hashes:
                mask = held.get(h, 0) & keep
                if mask:
                    held[h] = mask
                else:
                    held.pop(h, None)
        for tier, hashes in stored.items():
            bit = tier_bit(tier)
            for h in hashes:
                held[h] = held.get(h, 0) | bit

    def _flush_steps(self) -> None:
        with self._lock:
            steps = list(self._steps)
            self._steps.clear()
        if steps:
            try:
                self.publisher.report_steps(steps)
            except redis.RedisError:
                self.num_steps_dropped += len(steps)  # samples: the fit does without them
                raise

    def _take_events(self, timeout: float) -> list[list]:
        """Every queued batch, waiting up to ``timeout`` for one (or a step report, or a
        heartbeat asked for)."""
        with self._lock:
            if not (self._events or self._steps or self._beat_now):
                self._lock.wait(timeout)
            batches = [b for b in self._events if b is not None]
            self._events.clear()
            return batches
