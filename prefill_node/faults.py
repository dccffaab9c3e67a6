"""Fault injection for `pdserve chaos --scenario corrupt-kv` and tests: a KV sender that damages
its own transfers on purpose, so the receiver's checks can be seen to work end to end.

Off unless the node's own process turns it on (``PrefillServer.set_kv_fault``, reached through
the Ray actor's ``set_kv_fault`` or a test holding the server): no pdserve message can. It sends
the real wire messages (kv_transfer/wire.py) over gRPC to the decode node, with one byte of the
first chunk flipped after the checksum was taken ("flip"), or the stream ended after that chunk
without its trailer ("cut"). The receiver must refuse both (DATA_LOSS) and write nothing; the
router then has the decode node recompute the prompt.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import grpc

from kv_transfer.grpc_transport import KV_GRPC_OPTIONS, PUSH_BLOCKS_PATH
from kv_transfer.layout import PoolLayout
from kv_transfer.transport import PushResult, TransferError
from kv_transfer.wire import build_header, iter_wire_messages, payload_units
from protos.pdserve.v1 import kv_pb2
from security.tls import TlsFiles, channel

KV_FAULTS = ("flip", "cut")


class CorruptingKVSender:
    """``KVSender`` whose every push is damaged as ``mode`` says; counts them in ``pushes``."""

    def __init__(self, mode: str, tls: TlsFiles | None = None) -> None:
        if mode not in KV_FAULTS:
            raise ValueError(f"KV fault must be one of {KV_FAULTS}, got {mode!r}")
        self.mode = mode
        self.pushes = 0
        self._tls = tls
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def push(self, address: str, pool, *, request_id: str, fingerprint: str, src_block_ids: Sequence[int],
             block_hashes: Sequence[int], num_tokens: int, dest_block_ids: Sequence[int],
             skip_leading_blocks: int = 0, layers: range | None = None, timeout: float | None = None,
             **_) -> PushResult:
        layout = PoolLayout.of(pool)
        layers = range(layout.num_layers) if layers is None else layers  # a streamed push: some layers
        header = build_header(request_id=request_id, fingerprint=fingerprint, layout=layout,
                              dest_block_ids=dest_block_ids, block_hashes=list(block_hashes)[skip_leading_blocks:],
                              num_tokens=num_tokens, layers=layers, first_block_index=skip_leading_blocks,
                              checksum_algorithm=kv_pb2.CHECKSUM_ALGORITHM_CRC32)
        units = payload_units(pool, list(src_block_ids)[skip_leading_blocks:], layers)
        with self._lock:
            self.pushes += 1
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = channel(address, self._tls, KV_GRPC_OPTIONS)
        call = ch.stream_unary(PUSH_BLOCKS_PATH, request_serializer=None,
                               response_deserializer=kv_pb2.PushBlocksResponse.FromString)
        try:
            resp = call(self._damaged(iter_wire_messages(header, units)), timeout=timeout)
        except grpc.RpcError as err:
            raise TransferError(err.code(), err.details() or "") from None
        return PushResult(resp.blocks_written, resp.bytes_written)

    def _damaged(self, messages: Iterator[bytes]) -> Iterator[bytes]:
        for raw in messages:
            msg = kv_pb2.KVBlockMessage.FromString(raw)
            if msg.WhichOneof("kind") == "chunk":
                if self.mode == "cut":
                    yield raw
                    return
                data = bytearray(msg.chunk.data)
                data[len(data) // 2] ^= 0xFF
                msg.chunk.data = bytes(data)
                raw = msg.SerializeToString()
            yield raw

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
