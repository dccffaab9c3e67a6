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

Redis Cluster: a ``redis+cluster://host:port`` URL (``rediss+cluster://`` with TLS) gives a
``RedisCluster`` client, which finds the other masters from that one, follows slot moves and
a failover to a replica (it refreshes its slot map when a master stops answering). The index's
keys share one hash tag (kv_index/schema.py), so every script runs on one master. The same
bounds apply to each connection it opens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

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


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def redis_client(url: str, timeouts: RedisTimeouts = RedisTimeouts()) -> redis.Redis:
    """A client for ``url`` (``redis://`` or ``rediss://``, password included: see
    ``redis_url.resolve_redis_url``; ``redis+cluster://`` for a ``RedisCluster``) whose every
    wait is bounded by ``timeouts``. Thread-safe: its pool gives each thread a connection of
    its own."""
    if is_cluster_url(url):
        from redis.cluster import RedisCluster

        parts = urlsplit(url)
        return RedisCluster.from_url(
            urlunsplit(parts._replace(scheme=CLUSTER_SCHEMES[parts.scheme])),
            socket_connect_timeout=timeouts.connect_s,
            socket_timeout=timeouts.reply_s,
            # One retry, at once, after the slot map's refresh: a failed-over master's replica
            # answers; a hung master costs one more timeout, never a backoff's sleep.
            retry=Retry(NoBackoff(), 1),
        )
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=timeouts.connect_s,
        socket_timeout=timeouts.reply_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
    )


def reply_timeout(client) -> float | None:
    """The reply bound (seconds) ``client`` was built with (None: unbounded), plain or cluster."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return pool.connection_kwargs.get("socket_timeout")
    manager = getattr(client, "nodes_manager", None)
    return manager.connection_kwargs.get("socket_timeout") if manager is not None else None


def execute_with_time(r, p, key: str, at: int) -> list:
    """Execute pipeline ``p`` (built on ``r``, without TIME) and put Redis's TIME among its
    results at index ``at``. One round trip on one Redis (TIME rides in the pipeline); on a
    Redis Cluster, where a pipeline cannot carry TIME, a second call asks the master serving
    ``key`` (the index's hash tag: the clock the scripts use)."""
    if hasattr(r, "get_node_from_key"):
        out = list(p.execute())
        t = r.time(target_nodes=r.get_node_from_key(key))
    else:
        p.time()
        out = list(p.execute())
        t = out.pop()
    out.insert(at, t)
    return out
