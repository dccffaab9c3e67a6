"""Which peers a node lets into a prefix fetch (docs/security.md, "Prefix fetch").

What a fetch lands is registered as shared cache and served to every later request, and KV
bytes cannot be checked against their tokens; a Prefill call, or a PushPrefix, may name any
address. So both ends of a fetch check the other against this cluster's registry in Redis
(written only by nodes, behind its password) and, when one is configured, the cluster token
(security/cluster_token.py)::

    fetching node   holder_problem(address)    the holder is a live registered node serving
                                               this model; nothing is reserved or dialled before
    holder          dest_problem(address,      the node it would push to is one too, and every
                      endpoints)               data endpoint named is on that node's host
    both            token                      PushPrefix carries the token's MAC; pushes carry
                                               a reservation token only a member can derive

The registry is read at most every ``REFRESH_S`` (sooner, at most every ``MIN_REFRESH_S``, for
an address it does not know, such as a node that just started); a Redis that does not answer
leaves the last view in use, and with none, every peer is refused.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import redis

from kv_index.nodes import NodeInfo
from kv_index.reader import IndexReader
from kv_transfer.dist_transport import SCHEME as DIST_SCHEME
from kv_transfer.dist_transport import parse_dist_endpoint
from kv_transfer.shm_transport import SCHEME as SHM_SCHEME
from kv_transfer.shm_transport import parse_shm_endpoint
from kv_transfer.tcp_transport import SCHEME as TCP_SCHEME
from kv_transfer.tcp_transport import parse_endpoint
from security.cluster_token import ClusterToken
from telemetry.log_limit import RateLimitedLog

log = logging.getLogger(__name__)
registry_log = RateLimitedLog(log)

REFRESH_S = 1.0
MIN_REFRESH_S = 0.2

_PARSERS: dict[str, Callable[[str], tuple]] = {
    SHM_SCHEME: lambda e: parse_shm_endpoint(e)[1:],
    DIST_SCHEME: parse_dist_endpoint,
    TCP_SCHEME: parse_endpoint,
}


def address_host(address: str) -> str:
    """``host:port`` (IPv6 in brackets) -> host."""
    return address.rpartition(":")[0].strip("[]")


def endpoint_host(endpoint: str) -> str | None:
    """The host a data endpoint (shm, dist, tcp) makes a sender dial; None when not one of them."""
    parse = _PARSERS.get(endpoint.partition("://")[0])
    if parse is None:
        return None
    try:
        return parse(endpoint)[0]
    except ValueError:
        return None


class PeerRegistry:
    """The live nodes of one namespace by gRPC address, from Redis (``redis_of()``: the node's
    client, None before it started)."""

    def __init__(self, redis_of: Callable[[], redis.Redis | None], namespace: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis_of = redis_of
        self.namespace = namespace
        self._clock = clock
        self._lock = threading.Lock()
        self._by_address: dict[str, NodeInfo] | None = None
        self._read_at = float("-inf")

    def lookup(self, address: str) -> NodeInfo | None:
        """The live node registered at ``address``, or None."""
        with self._lock:  # one reader at a time; the others wait for its view
            age = self._clock() - self._read_at
            known = self._by_address or {}
            if age >= REFRESH_S or (address not in known and age >= MIN_REFRESH_S):
                self._refresh()
            return (self._by_address or {}).get(address)

    def _refresh(self) -> None:
        self._read_at = self._clock()
        client = self._redis_of()
        if client is None:
            return
        try:
            nodes = IndexReader(client, self.namespace).live_nodes()
        except redis.RedisError as err:
            registry_log.warning("registry unreadable", "the node registry could not be read (%s); prefix "
                                 "fetch peers are checked against the last view (none: refused)", err)
            return
        self._by_address = {n.grpc_address: n for n in nodes.values()}


class PeerTrust:
    """A node's checks on its prefix-fetch peers (``node``: a NodeServer; its Redis client is
    read when a check runs, so it may be made before the node started)."""

    def __init__(self, node) -> None:
        cfg = node.config
        # Read where the server is built (on its Ray worker), like the TLS files.
        self.token = ClusterToken.from_file(cfg.cluster_token_file) if cfg.cluster_token_file else None
        self.registry = PeerRegistry(lambda: getattr(node, "_redis", None), cfg.namespace)

    def push_token(self, nonce: bytes) -> bytes:
        """The reservation token of a fetch that sends ``nonce`` (the nonce itself without a
        cluster token: the link is then as open as the network, docs/security.md)."""
        return self.token.push_token(nonce) if self.token is not None else nonce

    def sign(self, payload: bytes) -> tuple[tuple[str, str], ...] | None:
        return self.token.metadata(payload) if self.token is not None else None

    def check_caller(self, metadata, payload: bytes):
        """None, or (status, message) refusing a PushPrefix without this cluster's token."""
        return self.token.check(metadata, payload) if self.token is not None else None

    def _registered(self, address: str, what: str) -> tuple[NodeInfo | None, str]:
        info = self.registry.lookup(address)
        if info is None:
            return None, (f"{what} {address!r} is no live node of this cluster's registry (namespace "
                          f"{self.registry.namespace!r}); a prefix moves only between registered nodes")
        return info, ""

    def holder_problem(self, address: str, fingerprint: str) -> str:
        """Why this node must not fetch from ``address`` ("" if it may)."""
        info, problem = self._registered(address, "holder")
        if info is not None and info.fingerprint != fingerprint:
            return f"holder {address!r} ({info.node_id}) serves model {info.fingerprint!r}, not {fingerprint!r}"
        return problem

    def dest_problem(self, address: str, endpoints: Sequence[str]) -> str:
        """Why this node must not push a prefix to ``address`` over ``endpoints`` ("" if it may)."""
        info, problem = self._registered(address, "dest_address")
        if info is None:
            return problem
        host = address_host(address)
        for endpoint in endpoints:
            if endpoint_host(endpoint) != host:
                return (f"dest_kv_endpoints: {endpoint!r} is not a data endpoint on {info.node_id}'s host "
                        f"{host!r}; a push dials only the registered node")
        return ""
