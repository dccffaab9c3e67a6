"""KV blocks over a gRPC client stream: ``push_blocks`` / ``GrpcKVSender`` (prefill node) and
``KVReceiver`` (decode node's PushBlocks).

The receiver never writes a partial or unchecked transfer: header checks run when the header
arrives, chunks are buffered (bounded by the validated header), and only after the trailer's
checksum matches is the buffer scattered into the pool, with one index_copy_.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import grpc
import torch

from kv_transfer.buffers import BufferPool
from kv_transfer.layout import PoolLayout
from kv_transfer.transport import PushResult, TransferError
from kv_transfer.validate import (
    HeaderGate,
    KVDataLossError,
    KVValidationError,
    ReceivedBlocks,
    Reservation,
    status_code,
)
from kv_transfer.wire import (
    CHUNK_BYTES,
    PayloadAssembler,
    build_header,
    iter_wire_messages,
    payload_units,
    write_payload,
)
from protos.conventions import grpc_options, keepalive_channel_options, keepalive_server_options
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from security.tls import TlsFiles, channel

# Chunks are ~1 MiB and headers of long prompts (~13 bytes per block) stay far below this;
# the default 4 MiB receive limit would already do, 16 MiB leaves room for larger chunk_bytes.
MAX_KV_MESSAGE_BYTES = 16 << 20
# Both ends of a KV stream (the prefill node's channel, every node's server). The window lets a
# sender of MiB-sized chunks run ahead instead of waiting on the 64 KiB default.
# A server made with them accepts the keepalive pings of KV_CHANNEL_OPTIONS (without that,
# gRPC closes a pinging client's connection within seconds: "too_many_pings").
KV_GRPC_OPTIONS = grpc_options(MAX_KV_MESSAGE_BYTES, stream_window_bytes=16 << 20) + keepalive_server_options()
# The prefill node's channels to decode nodes ping (keepalive): a push to a frozen decode node
# fails within seconds (UNAVAILABLE) instead of waiting on flow control.
KV_CHANNEL_OPTIONS = grpc_options(MAX_KV_MESSAGE_BYTES, stream_window_bytes=16 << 20) + keepalive_channel_options()


_PUSH_BLOCKS = kv_pb2.DESCRIPTOR.services_by_name["KVTransfer"].methods_by_name["PushBlocks"]
PUSH_BLOCKS_PATH = f"/{_PUSH_BLOCKS.containing_service.full_name}/{_PUSH_BLOCKS.name}"


def push_blocks(
    channel: grpc.Channel,
    pool: torch.Tensor,
    *,
    request_id: str,
    fingerprint: str,
    src_block_ids: Sequence[int],
    block_hashes: Sequence[int],
    num_tokens: int,
    dest_block_ids: Sequence[int],
    token: bytes,
    skip_leading_blocks: int = 0,
    layers: range | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    checksum_algorithm: int = kv_pb2.CHECKSUM_ALGORITHM_XXH3_64,
    timeout: float | None = None,
) -> kv_pb2.PushBlocksResponse:
    """Stream the KV of one request's blocks from ``pool`` to a decode node.

    ``src_block_ids`` / ``block_hashes`` are the request's whole block sequence on this node
    (hashes: full blocks only). The first ``skip_leading_blocks`` of them are already held by
    the receiver (ReserveBlocksResponse.num_cached_blocks) and are not sent;
    ``dest_block_ids`` (ReserveBlocksResponse.block_ids) receive the rest, in order;
    ``token`` (ReserveBlocksResponse.token) opens that reservation.

        request blocks:  [ b0 b1 | b2 b3 b4 ]      skip_leading_blocks = 2
                           held    sent -> dest_block_ids[0..3)

    ``layers`` (default: all) lets a caller stream layer groups as prefill finishes them.
    Raises grpc.RpcError with the receiver's status when it refuses the transfer.

    Takes a channel rather than a KVTransferStub: the messages are serialized here (chunks
    straight from the pool, see wire.encode_chunk), so the call passes bytes through unchanged.
    """
    layout = PoolLayout.of(pool)
    send_ids = list(src_block_ids)[skip_leading_blocks:]
    if len(send_ids) != len(dest_block_ids):
        raise ValueError(
            f"{len(send_ids)} blocks to send after skipping {skip_leading_blocks}, "
            f"but {len(dest_block_ids)} dest_block_ids"
        )
    layers = range(layout.num_layers) if layers is None else layers
    header = build_header(
        request_id=request_id,
        fingerprint=fingerprint,
        layout=layout,
        dest_block_ids=dest_block_ids,
        block_hashes=list(block_hashes)[skip_leading_blocks:],
        num_tokens=num_tokens,
        layers=layers,
        first_block_index=skip_leading_blocks,
        checksum_algorithm=checksum_algorithm,
        token=token,
    )
    units = payload_units(pool, send_ids, layers)
    call = channel.stream_unary(
        PUSH_BLOCKS_PATH,
        request_serializer=None,  # iter_wire_messages yields serialized KVBlockMessages
        response_deserializer=kv_pb2.PushBlocksResponse.FromString,
    )
    return call(iter_wire_messages(header, units, chunk_bytes), timeout=timeout)


class KVReceiver(kv_pb2_grpc.KVTransferServicer):
    """PushBlocks into one KV pool. The decode node delegates PushBlocks to it and serves
    ReserveBlocks / ReleaseReservation itself, which own the reservations ``reservation_for`` reads.

    ``on_received`` runs on the gRPC worker thread after the blocks are in the pool and before
    the sender is answered; an exception there fails the RPC with INTERNAL.
    Writes of different requests may run concurrently: reservations keep their blocks disjoint.
    The owner of the reservations must not hand a reserved block to anyone else while a
    PushBlocks for it is in flight (release after the stream ends, or on its lease expiry).
    """

    def __init__(
        self,
        pool: torch.Tensor,
        fingerprint: str,
        on_received: Callable[[ReceivedBlocks], None],
        reservation_for: Callable[[str], Reservation | None],
        buffers: BufferPool | None = None,
    ) -> None:
        self._pool = pool
        self._gate = HeaderGate(PoolLayout.of(pool), fingerprint, reservation_for)
        self._on_received = on_received
        self._buffers = buffers or BufferPool()

    def PushBlocks(self, request_iterator, context: grpc.ServicerContext) -> kv_pb2.PushBlocksResponse:
        buffer = None
        try:
            header, buffer, payload = self._receive(request_iterator)
            write_payload(self._pool, header, payload)
        except KVValidationError as err:
            context.abort(status_code(err), str(err))
        finally:
            if buffer is not None:
                self._buffers.release(buffer)
        received = ReceivedBlocks.of(header)
        try:
            self._on_received(received)
        except Exception as err:  # the sender must learn the blocks were not taken
            context.abort(grpc.StatusCode.INTERNAL, f"on_received failed: {err!r}")
        return kv_pb2.PushBlocksResponse(blocks_written=len(received.block_ids), bytes_written=header.payload_bytes)

    def _receive(self, messages) -> tuple[kv_pb2.KVHeader, bytearray, memoryview]:
        """Header, chunks, trailer -> (header, buffer, checked payload in it).

        Raises KVValidationError; the buffer goes back to the pool on every path.
        """
        header = self._gate.accept(next(messages, None))
        buffer = self._buffers.acquire(header.payload_bytes)
        try:
            assembler = PayloadAssembler(header, buffer)
            for msg in messages:
                kind = msg.WhichOneof("kind")
                if kind == "chunk":
                    assembler.add(msg.chunk)
                elif kind == "trailer":
                    payload = assembler.finish(msg.trailer)
                    if next(messages, None) is not None:
                        raise KVValidationError("stream: got a message after the trailer, expected end")
                    return header, buffer, payload
                else:
                    raise KVValidationError(f"message after header: got {kind}, expected chunk or trailer")
            raise KVDataLossError(
                f"stream ended without trailer after {assembler.received} of {header.payload_bytes} payload bytes"
            )
        except BaseException:
            self._buffers.release(buffer)
            raise


class GrpcKVSender:
    """``KVSender`` over gRPC: one long-lived channel per receiving node, so connection setup
    stays off the hot path. Thread-safe (a prefill node pushes from several gRPC threads)."""

    def __init__(self, tls: TlsFiles | None = None) -> None:
        self._tls = tls  # mutual TLS to the receivers when set (security/tls.py)
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()  # guards _channels

    def push(self, address: str, pool: torch.Tensor, *, endpoints: Sequence[str] = (), **blocks) -> PushResult:
        """``push_blocks`` to the node at ``address``; ``blocks`` are its keyword arguments
        (``endpoints``, the decode node's other transports, are not this sender's concern).
        A refusal or an unreachable receiver raises TransferError with the gRPC status."""
        try:
            resp = push_blocks(self._channel(address), pool, **blocks)
        except grpc.RpcError as err:
            raise TransferError(err.code(), err.details() or "") from None
        return PushResult(resp.blocks_written, resp.bytes_written)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = channel(address, self._tls, KV_CHANNEL_OPTIONS)
            return ch
