"""Every Redis client of the project, built in one place, with bounded waits.

A Redis that hangs (a stopped process, a black-holed host, a full accept queue) answers no
error: without a bound a caller waits for it as long as the kernel keeps the connection. So
every client gets two bounds:

    connect_s   to open a connection (the TCP handshake; AUTH and the first reply fall under
                reply_s). In a cluster or on loopback a connect takes well under a millisecond;
                1 s covers a lost SYN's first retransmission (Linux waits 1 s) and little more.
    reply_s     for each reply (a command, a pipeline, a script call). The router's prefix
                lookup is on the request path and gets a short one of its own
                (RouterConfig.index_lookup_timeout_s); everything else runs on background
                threads (heartbeats, block events, registry reads) and gets a longer one, which
                must cover a node's full resync of its block snapshot (one script call).

A failed connection is retried once at once (a pooled connection that a restarted Redis
closed); a timeout is never retried: it would double the wait on a hung Redis. Every command
we send is a read, idempotent, or guarded by the node's event sequence number (``schema.py``),
so a retry, or a timed-out command that Redis still runs when it wakes, never corrupts the
index: at worst a node resyncs.

redis-py's own defaults differ by release (none before 6, 5 s to connect and per reply since):
nothing here depends on them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


@dataclass(frozen=True, slots=True)
class RedisTimeouts:
    """Seconds to open a connection and to wait for each reply."""

    connect_s: float = 1.0
    reply_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("connect_s", "reply_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"Redis {name} must be a finite number of seconds > 0, got {v}")


def redis_client(url: str, timeouts: RedisTimeouts = RedisTimeouts()) -> redis.Redis:
    """A client for ``url`` (``redis://`` or ``rediss://``, password included: see
    ``redis_url.resolve_redis_url``) whose every wait is bounded by ``timeouts``. Thread-safe:
    its pool gives each thread a connection of its own."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=timeouts.connect_s,
        socket_timeout=timeouts.reply_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
    )
