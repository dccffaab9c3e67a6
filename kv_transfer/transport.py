"""The one interface a prefill node moves KV through, whatever carries the bytes.

A sender pushes one request's blocks from its pool into the reservation a decode node made
for them; the receiver validates every header, byte count and checksum before writing (see
validate.py), so a transport only moves bytes. Implementations: ``GrpcKVSender`` (any two
hosts, grpc_transport.py), ``TcpKVSender`` (a raw TCP data stream beside gRPC,
tcp_transport.py), ``ShmKVSender`` (shared memory on one host, shm_transport.py),
``DistKVSender`` (a torch.distributed gloo group beside the data stream, dist_transport.py;
its NCCL backend for GPU pools is not built). ``FallbackKVSender`` picks one per transfer
from the endpoints the decode node advertises, fastest first, and falls back to gRPC; when
that fails too, the prefill fails and the router recomputes the prompt on the decode node
(docs/cluster.md, "KV data plane").

A push need not carry a whole reservation: ``layers`` picks a layer range, and blocks [a, b)
of a prompt go as ``src_block_ids=table[:b]``, ``skip_leading_blocks=a``, ``dest_block_ids`` =
the reservation's ids for [a, b), the hashes of its full blocks, ``num_tokens = min(b *
block_size, prompt length)``. The receiver accepts any contiguous run of its reservation and
admits the request once every (layer, block) landed. That is how a prefill node streams KV
layer by layer while it still computes (prefill_node/kv_streamer.py): many pushes of
rectangles (a layer range x a block range) through the same sender, one at a time per request.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import grpc

from telemetry.log_limit import RateLimitedLog

log = logging.getLogger(__name__)
# Fallbacks, per transport and status: a decode node whose fast endpoint is down fails every
# push to it, and under load that is a line per push; the first in full, then a count every 10 s.
fallback_log = RateLimitedLog(log)

# Codes that say the transport failed rather than that the receiver refused the transfer:
# another transport may succeed. A refusal (INVALID_ARGUMENT, NOT_FOUND, ...) would only repeat.
TRANSPORT_FAILURES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
})


class PushResult(NamedTuple):
    blocks_written: int
    bytes_written: int
    transport: str = "grpc"  # what carried it: "grpc", or an endpoint's scheme ("tcp")
    # Wall time of the attempt that landed (FallbackKVSender sets it; 0.0: not measured), and
    # the failed attempts before it on faster transports, whose time it leaves out: a cost
    # model fed this learns the transport that carried the bytes, not the detour.
    seconds: float = 0.0
    fallbacks: int = 0


class TransferError(Exception):
    """A push that did not land; nothing was written into the receiver's pool. ``code`` is the
    status the receiver answered (INVALID_ARGUMENT, DATA_LOSS, NOT_FOUND, UNAUTHENTICATED,
    PERMISSION_DENIED), or UNAVAILABLE / DEADLINE_EXCEEDED when it could not be reached in
    time."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class TransportSkipped(TransferError):
    """A transport that does not apply to this transfer and tried nothing (a shared-memory
    endpoint of another host, a transfer larger than its buffer): the next one is taken
    without counting a fallback. Code UNAVAILABLE, for callers that only know TransferError."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, details)


class KVSender(Protocol):
    def push(self, address: str, pool, *, request_id: str, fingerprint: str, src_block_ids, block_hashes,
             num_tokens: int, dest_block_ids, token: bytes, skip_leading_blocks: int = 0,
             layers: range | None = None, timeout: float | None = None, endpoints: Sequence[str] = ()) -> PushResult:
        """Send blocks ``src_block_ids[skip_leading_blocks:]`` of ``pool`` (all layers, or
        ``layers``) into ``dest_block_ids`` of the node at ``address`` (its gRPC address;
        ``endpoints``: its other transports, ReserveBlocksResponse.kv_endpoints), in the
        reservation ``token`` opens (ReserveBlocksResponse.token). Raises TransferError."""
        ...

    def close(self) -> None:
        """Release connections; the sender is not used afterwards."""
        ...


class EndpointSender(Protocol):
    """A fast transport: pushes to one of the decode node's advertised endpoints
    (``scheme://...``); same keyword arguments and errors as ``KVSender.push``."""

    scheme: str

    def push(self, endpoint: str, pool, **blocks) -> PushResult: ...

    def advertised(self) -> str:
        """What a sending node advertises in the index for this transport: its scheme and, where
        it matters, its host key, without an address (``tcp://``, ``shm://<host key>/``); the
        router guesses a pair's transport from it before the pair's first transfer."""
        ...

    def close(self) -> None: ...


def endpoint_scheme(endpoint: str) -> str:
    return endpoint.partition("://")[0]


class FallbackKVSender:
    """``KVSender`` that tries the decode node's advertised endpoints it has a transport for,
    in the order advertised, then the gRPC sender. Only a transport failure (TRANSPORT_FAILURES)
    moves on to the next; the last error is raised. Thread-safe if the senders are."""

    def __init__(self, fast: Sequence[EndpointSender], grpc_sender) -> None:
        self._fast = {s.scheme: s for s in fast}
        self._grpc = grpc_sender
        self.num_fallbacks = 0  # fast transfers that failed and were retried on another transport

    @property
    def schemes(self) -> tuple[str, ...]:
        return tuple(self._fast)

    def advertised(self) -> tuple[str, ...]:
        """This sender's fast transports as the index shows them (``EndpointSender.advertised``)."""
        return tuple(s.advertised() for s in self._fast.values())

    def push(self, address: str, pool, *, endpoints: Sequence[str] = (), **blocks) -> PushResult:
        """``blocks`` as for ``KVSender.push``; ``endpoints`` from the decode node's reservation.
        The result's ``seconds`` times only the attempt that landed; ``fallbacks`` counts the
        failed ones before it (a skipped transport, ``TransportSkipped``, is neither)."""
        fallbacks = 0
        for endpoint in endpoints:
            sender = self._fast.get(endpoint_scheme(endpoint))
            if sender is None:
                continue
            t0 = time.monotonic()
            try:
                result = sender.push(endpoint, pool, **blocks)
            except TransportSkipped:
                continue
            except TransferError as err:
                if err.code not in TRANSPORT_FAILURES:
                    raise
                fallbacks += 1
                self.num_fallbacks += 1
                fallback_log.warning(f"KV fallback from {sender.scheme} on {err.code.name}",
                                     "KV transfer of %r over %s failed (%s); falling back",
                                     blocks.get("request_id"), endpoint, err)
                continue
            return result._replace(transport=sender.scheme, seconds=time.monotonic() - t0, fallbacks=fallbacks)
        t0 = time.monotonic()
        result = self._grpc.push(address, pool, **blocks)
        return result._replace(seconds=time.monotonic() - t0, fallbacks=fallbacks)

    def close(self) -> None:
        for s in (*self._fast.values(), self._grpc):
            s.close()
