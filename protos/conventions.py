"""What every pdserve gRPC endpoint agrees on beyond the messages: how channels and servers
are configured, and the trailing-metadata key that carries a retry hint.

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
