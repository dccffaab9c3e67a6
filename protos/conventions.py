"""What every pdserve gRPC endpoint agrees on beyond the messages: how channels and servers
are configured (message limits, keepalive), and the trailing-metadata key that carries a
retry hint.

The SDK, the router and the nodes all import this one module (grpc and protobuf only: no
torch, no server code), so a limit or a key is changed in one place.
"""
from __future__ import annotations

from collections.abc import Iterable

# Largest message a client-facing endpoint sends or accepts. Prompts travel as token ids
# (~5 bytes each on the wire), so this admits any context length a model has.
MAX_MESSAGE_BYTES = 64 << 20

# Trailing metadata of a RESOURCE_EXHAUSTED status: how long (integer milliseconds) the caller
# should wait before retrying. The SDK turns it into ResourceExhaustedError.retry_after_s.
RETRY_AFTER_MS_KEY = "retry-after-ms"


def grpc_options(max_message_bytes: int = MAX_MESSAGE_BYTES, *,
                 stream_window_bytes: int | None = None) -> list[tuple[str, int]]:
    """Options for ``grpc.server`` / ``grpc.*_channel`` (both ends of a hop use the same).

    ``stream_window_bytes``: how far a receiver lets a stream run ahead of what it has read
    (its HTTP/2 flow-control window target, ``grpc.http2.lookahead_bytes``). Bulk streams of
    MiB-sized messages set it: with gRPC's 64 KiB default the sender keeps waiting for window
    updates (docs/benchmarks.md has the transfer figures).
    """
    opts = [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]
    if stream_window_bytes is not None:
        opts.append(("grpc.http2.lookahead_bytes", stream_window_bytes))
    return opts


# Keepalive on every hop inside the cluster (router -> nodes, prefill node -> decode node).
# A frozen peer (SIGSTOP, a stalled kernel, a partition that drops packets) keeps its TCP
# connection "open" for as long as nobody sends: its kernel still ACKs, or nothing says the
# link is gone, and a stream waits forever. An HTTP/2 PING needs the peer's gRPC to answer:
# the caller pings after KEEPALIVE_TIME_S and fails every call on the connection with
# UNAVAILABLE when no ack comes within KEEPALIVE_TIMEOUT_S: a SIGSTOPped server is detected
# 3-4 s after it stopped (the next ping within 1 s, then 3 s without its ack). A wedged engine behind a live gRPC thread still answers pings: the
# router's progress deadline on each Decode stream catches that one (docs/cluster.md).
# 1 s + 3 s keep the worst case at 4 s, under the cluster's 5 s detection target (with 2 s +
# 3 s a frozen prefill node took 5.00 s in `pdserve chaos --scenario freeze-prefill`), and cost
# one 17-byte frame per connection a second; the timeout leaves a loaded peer 3 s to answer
# (acks come from gRPC's own threads, not from Python, so a busy interpreter does not delay them).
KEEPALIVE_TIME_S = 1.0
KEEPALIVE_TIMEOUT_S = 3.0


def keepalive_ping_options(time_s: float = KEEPALIVE_TIME_S,
                           timeout_s: float = KEEPALIVE_TIMEOUT_S) -> list[tuple[str, int]]:
    """Ping the peer every ``time_s``; fail the connection when an ack takes over ``timeout_s``.

    ``grpc.http2.ping_timeout_ms`` is set with ``grpc.keepalive_timeout_ms``: gRPC 1.85 waits
    for a keepalive ping's ack by the former (default 60 s), not the latter. No limit on pings
    between data frames: a Decode stream's client sends nothing after its request, and gRPC's
    default would stop pinging after two pings.
    """
    return [("grpc.keepalive_time_ms", int(time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),
            ("grpc.http2.max_pings_without_data", 0)]


def keepalive_channel_options() -> list[tuple[str, int]]:
    """A channel's side of keepalive: the pings, on idle connections too (so the next call
    does not start on a dead one)."""
    return keepalive_ping_options() + [("grpc.keepalive_permit_without_calls", 1)]


# gRPC's reconnect back-off grows to 120 s by default (initial 1 s, x1.6): a node that was
# down for ten seconds and came back at the same address (a Ray restart, a replaced host) had the
# router's channel still backing off, failing calls there at once ("failed to connect to all
# addresses") for seconds after the node served again. Inside a cluster a dead address asked
# once a second is cheap.
RECONNECT_INITIAL_MS, RECONNECT_MAX_MS = 250, 1000


def reconnect_channel_options() -> list[tuple[str, int]]:
    """A channel to a cluster member: reconnect attempts at most ``RECONNECT_MAX_MS`` apart."""
    return [("grpc.initial_reconnect_backoff_ms", RECONNECT_INITIAL_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS)]


def keepalive_server_options(*, ping_clients: bool = False,
                             min_ping_interval_s: float = KEEPALIVE_TIME_S / 2) -> list[tuple[str, int]]:
    """A server's side: accept the channels' pings. gRPC servers answer a client that pings
    more often than every 5 minutes (or at all without a call in flight) with GOAWAY
    "too_many_pings", which closes a pinging router's connection within seconds (measured: 6 s
    with gRPC's defaults); this accepts one every ``min_ping_interval_s`` (half the channels'
    interval, so timer jitter never counts as abuse), with or without calls. ``ping_clients``:
    the server pings its clients as well (the nodes, inside the cluster: a frozen router's
    streams are then cancelled on the node and their KV blocks freed, instead of waiting on
    flow control). Not for the router's client-facing port: a client on a slow network must not
    lose its stream to a 3 s ping timeout."""
    opts = [("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", int(min_ping_interval_s * 1000)),
            ("grpc.http2.max_ping_strikes", 2)]
    return opts + keepalive_ping_options() if ping_clients else opts


def retry_after_metadata(ms: int) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that tells the caller to retry after ``ms`` milliseconds."""
    return ((RETRY_AFTER_MS_KEY, str(int(ms))),)


def retry_after_ms(metadata: Iterable[tuple[str, str | bytes]] | None) -> int | None:
    """The retry hint in a call's trailing metadata; None when absent or malformed."""
    for key, value in metadata or ():
        if key == RETRY_AFTER_MS_KEY:
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None
