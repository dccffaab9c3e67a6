"""The one interface a prefill node moves KV through, whatever carries the bytes.

A sender pushes one request's blocks from its pool into the reservation a decode node made
for them; the receiver validates every header, byte count and checksum before writing (see
validate.py), so a transport only moves bytes. Implementations: ``GrpcKVSender`` (any two
hosts, grpc_transport.py). Transports for the same host (shared memory) and for GPUs (NCCL)
go behind the same ``push``.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import grpc


class PushResult(NamedTuple):
    blocks_written: int
    bytes_written: int


class TransferError(Exception):
    """A push that did not land; nothing was written into the receiver's pool. ``code`` is the
    status the receiver answered (INVALID_ARGUMENT, DATA_LOSS, NOT_FOUND), or UNAVAILABLE /
    DEADLINE_EXCEEDED when it could not be reached in time."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class KVSender(Protocol):
    def push(self, address: str, pool, *, request_id: str, fingerprint: str, src_block_ids, block_hashes,
             num_tokens: int, dest_block_ids, skip_leading_blocks: int = 0, layers: range | None = None,
             timeout: float | None = None) -> PushResult:
        """Send blocks ``src_block_ids[skip_leading_blocks:]`` of ``pool`` (all layers, or
        ``layers``) into ``dest_block_ids`` of the node at ``address``. Raises TransferError."""
        ...

    def close(self) -> None:
        """Release connections; the sender is not used afterwards."""
        ...
