"""The crash-loop guard a node actor runs around its start (node/health.py says why Ray's own
restarts do not bound a crash loop): it reads and writes the node's health record in Redis
(kv_index/health.py), waits out the back-off before each start, and says when to stay down.

One record per node id survives the actor's restarts (a restarted actor is a new process,
maybe on another machine), so the count of failed lives is kept there. Each start is counted
as failed before it begins and taken back once it worked, so a process that dies while
loading (killed for memory, a crash in native code) counts without a chance to say so; the
next life finds the record still ``starting`` and writes that down as the reason.

Redis unreachable: the record cannot be read, so a restarted actor waits the longest back-off
before it tries (it cannot serve without Redis anyway) and the loop goes on slowly until
Redis answers.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from kv_index.health import DOWN, SERVING, STARTING, UNHEALTHY, HealthRecord, HealthStore
from node.health import StartPolicy

log = logging.getLogger(__name__)


class NodeDownError(RuntimeError):
    """The node failed ``max_start_failures`` lives in a row and stays down (raised from the
    actor's constructor: Ray does not restart an actor whose constructor raised)."""


class StartGuard:
    """One life of one node actor: ``before_start`` -> ``started`` or ``start_failed`` ->
    (``proven``) -> ``unhealthy`` or ``clear``. Every Redis failure is logged, never raised."""

    def __init__(self, store: HealthStore, node_id: str, policy: StartPolicy, *, reconstructed: bool,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.store = store
        self.node_id = node_id
        self.policy = policy
        self.reconstructed = reconstructed  # Ray restarted this actor (not its first life)
        self._sleep = sleep
        self.failures = 0  # failed lives in a row before this one
        self.restarts = 0
        self.pending = False  # failures > 0 and no good step yet in this life

    def before_start(self) -> None:
        """Wait out the back-off; raises NodeDownError when the node is to stay down."""
        try:
            rec = self.store.read(self.node_id)
        except redis.RedisError as err:
            delay = self.policy.backoff_max_s if self.reconstructed else 0.0
            log.warning("%s: health record unreadable (%s); starting in %.0f s", self.node_id, err, delay)
            self._sleep(delay)
            return
        rec = rec or HealthRecord(self.node_id, "")
        self.failures, self.restarts = rec.failures, rec.restarts
        reason = rec.reason
        if self.reconstructed and rec.state in (STARTING, SERVING):  # the last life died unannounced
            reason = "its process died while " + ("starting" if rec.state == STARTING else "serving")
            self.restarts += 1
            self._write(rec.state, reason)
        if self.policy.gives_up(self.failures):
            self._write(DOWN, reason)
            raise NodeDownError(f"node {self.node_id} stays down after {self.failures} failed starts in a row; "
                                f"last: {reason}")
        delay = self.policy.delay_s(self.failures)
        if delay:
            log.warning("%s failed %d time(s) in a row (last: %s); starting again in %.1f s",
                        self.node_id, self.failures, reason, delay)
            self._sleep(delay)
        self._write(STARTING, failures=self.failures + 1)  # a death from here on counts

    def started(self) -> None:
        self.pending = self.failures > 0
        self._write(SERVING, failures=self.failures)

    def start_failed(self, err: BaseException) -> bool:
        """Record a failed start; returns whether the node now stays down."""
        return self._failed(f"start failed: {err!r}")

    def proven(self) -> None:
        """This life made a good engine step: the failures before it are forgiven."""
        if self.pending:
            self.pending, self.failures = False, 0
            self._write(SERVING, failures=0)

    def unhealthy(self, reason: str) -> bool:
        """Record a life that ended unhealthy; returns whether the node now stays down."""
        return self._failed(reason)

    def clear(self) -> None:
        """The node stops on purpose (drain, scale-down): nothing to report."""
        try:
            self.store.clear(self.node_id)
        except redis.RedisError as err:
            log.warning("%s: could not clear its health record: %s", self.node_id, err)

    def _failed(self, reason: str) -> bool:
        self.failures += 1
        self.restarts += 1
        down = self.policy.gives_up(self.failures)
        self._write(DOWN if down else UNHEALTHY, reason)
        return down

    def _write(self, state: str, reason: str | None = None, **counts: int) -> None:
        counts = {"failures": self.failures, "restarts": self.restarts, **counts}
        try:
            self.store.write(self.node_id, state, reason, **counts)
        except redis.RedisError as err:
            log.warning("%s: could not record its health (%s): %s", self.node_id, state, err)
