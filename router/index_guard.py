"""The prefix lookup on the request path, guarded so that a hung or absent Redis costs a request
at most one short timeout, and most requests nothing.

The index is a hint: a request placed without it is placed by load and costs a cache miss,
never a wrong answer. So after one failed lookup the router stops asking (the breaker opens)
and places without the index; its node-view thread (router/node_view.py) probes Redis off
the request path and closes the breaker when Redis answers again:

    closed              --a lookup fails-->              open
    open                --probe due, PING fails-->       open (probe again after the same wait)
    open                --probe due, PING answers-->     closed (unverified)
    closed (unverified) --a lookup answers-->            closed (the backoff resets)
    closed (unverified) --a lookup fails-->              open, the wait before the next probe doubled

A PING that answers while lookups still time out (a Redis slow rather than gone) would close
and reopen the breaker every probe, each time costing one request a timeout: a lookup that
fails right after a probe closed the breaker doubles the wait before the next probe (up to
``max_s``); a lookup that succeeds resets it.

``LookupBreaker`` is the decision alone (plain data, a clock passed in); ``GuardedLookup``
puts it around ``IndexReader.match``, or around the router's local copy of the index
(``local``: kv_index/event_feed.py, ``--index-lookup local``): the copy answers the same, in
process, without a round trip or a lock, once it has synced (Redis answers until then). The
breaker gates both alike: while Redis is unreadable the copy is not fed either, so requests
are placed by load, as with a Redis lookup.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis

from kv_index.event_feed import EventFeed
from kv_index.nodes import PrefixMatch
from kv_index.reader import IndexReader

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LookupBreaker:
    """When to ask the index on the request path, and when to probe it. Not thread-safe (the
    caller holds a lock); times are monotonic seconds."""

    base_s: float = 0.5  # wait before the first probe after a failure
    max_s: float = 30.0  # longest wait between probes (after repeated flapping)
    open_since: float | None = None  # None: closed (lookups go to Redis)
    reason: str = ""  # the last failure, while open
    retry_at: float = 0.0  # when the next probe is due, while open
    flaps: int = 0  # lookups that failed right after a probe closed the breaker, in a row
    unverified: bool = False  # closed by a probe; no lookup has succeeded since

    @property
    def is_open(self) -> bool:
        return self.open_since is not None

    def allow(self) -> bool:
        """Whether a request should ask the index now."""
        return self.open_since is None

    def wait_s(self) -> float:
        return min(self.max_s, self.base_s * 2 ** self.flaps)

    def lookup_failed(self, now: float, reason: str) -> None:
        """A lookup on the request path failed (or the registry could not be read)."""
        if self.open_since is None:
            if self.unverified:
                self.flaps += 1
            self.open_since = now
        self.unverified = False
        self.reason = reason
        self.retry_at = now + self.wait_s()

    def lookup_succeeded(self) -> None:
        self.flaps = 0
        self.unverified = False

    def probe_due(self, now: float) -> bool:
        return self.open_since is not None and now >= self.retry_at

    def probed(self, now: float, ok: bool, reason: str = "") -> None:
        """The result of a probe (made because ``probe_due``)."""
        if ok:
            self.open_since, self.reason, self.unverified = None, "", True
        else:
            self.reason = reason or self.reason
            self.retry_at = now + self.wait_s()


class GuardedLookup:
    """``match`` as ``IndexReader.match``, but it never raises and never waits on a Redis known
    to be failing: while the breaker is open it answers ``{}`` (no prefix information) at once.
    Thread-safe: the request path's worker threads call ``match``, the node-view thread calls
    ``probe`` and ``trip``. ``reader`` should use a client with a short reply timeout (the
    request waits for it)."""

    def __init__(self, reader: IndexReader, breaker: LookupBreaker | None = None,
                 clock: Callable[[], float] = time.monotonic, local: EventFeed | None = None) -> None:
        self.reader = reader
        self.local = local  # the router's copy of the index; None: every lookup asks Redis
        self._breaker = breaker if breaker is not None else LookupBreaker()
        self._clock = clock
        self._lock = threading.Lock()
        self.failures = 0  # lookups that failed (timed out, refused, errored)
        self.skipped = 0  # lookups not made because the breaker was open

    def match(self, block_hashes: Sequence[int], node_ids: Sequence[str]) -> dict[str, PrefixMatch]:
        local = self.local
        if local is not None and local.ready.is_set():
            b = self._breaker
            # Lock-free while closed and settled: one attribute read decides, as a lookup of
            # the copy takes no lock (a request racing the breaker's change is placed either way).
            if b.open_since is None and not (b.unverified or b.flaps):
                return local.index.match(block_hashes, node_ids)
        with self._lock:
            allowed = self._breaker.allow()
            if not allowed:
                self.skipped += 1
        if not allowed:
            return {}
        if local is not None and local.ready.is_set():
            got = local.index.match(block_hashes, node_ids)
            with self._lock:
                self._breaker.lookup_succeeded()
            return got
        try:
            got = self.reader.match(block_hashes, node_ids)
        except redis.RedisError as e:
            self.trip(f"index lookup failed: {e}")
            with self._lock:
                self.failures += 1
            return {}
        with self._lock:
            self._breaker.lookup_succeeded()
        return got

    def trip(self, reason: str) -> None:
        """Open the breaker: lookups are skipped until a probe answers."""
        with self._lock:
            was_open = self._breaker.is_open
            self._breaker.lookup_failed(self._clock(), reason)
            wait = self._breaker.wait_s()
        if not was_open:
            log.warning("placing without the index (%s); probing Redis again in %.1f s", reason, wait)

    def probe(self) -> bool | None:
        """PING Redis if a probe is due (the breaker is open and its wait has passed); close the
        breaker if it answers. Blocks up to the client's timeout: call it off the request path.
        Returns the probe's result, None when none was due."""
        with self._lock:
            if not self._breaker.probe_due(self._clock()):
                return None
        try:
            self.reader.r.ping()
            ok, why = True, ""
        except redis.RedisError as e:
            ok, why = False, f"index lookup failed: Redis probe: {e}"
        with self._lock:
            self._breaker.probed(self._clock(), ok, why)
        if ok:
            log.info("Redis answers again: index lookups resume")
        return ok

    def start(self, timeout_s: float = 5.0) -> None:
        """Start the local copy's feed, if any, waiting up to ``timeout_s`` for its first sync
        (lookups ask Redis until it has synced)."""
        if self.local is not None and not self.local.start(timeout_s):
            log.warning("the local index copy has not synced within %.1f s; lookups ask Redis until it has",
                        timeout_s)

    def close(self) -> None:
        if self.local is not None:
            self.local.stop()

    @property
    def degraded(self) -> str | None:
        """Why lookups are skipped or answered from a copy no longer fed, or None."""
        with self._lock:
            b = self._breaker
            if b.is_open:
                return f"{b.reason}; placing by load without the index (since {self._clock() - b.open_since:.1f} s)"
        local = self.local
        since = local.error_since if local is not None else None
        if since is not None and local.ready.is_set():
            return f"{local.error}; lookups answered from the local index copy as of {time.monotonic() - since:.1f} s ago"
        return None
