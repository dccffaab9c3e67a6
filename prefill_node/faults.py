"""Fault injection for `pdserve chaos --scenario corrupt-kv` and tests: a KV sender that damages
its own transfers on purpose, so the receiver's checks can be seen to work end to end.

Off unless the node's own process turns it on (``PrefillServer.set_kv_fault``, reached through
the Ray actor's ``set_kv_fault`` or a test holding the server): no pdserve message can. It sends
the real wire messages (kv_transfer/wire.py) over gRPC to the decode node, with one byte of the
first chunk flipped after the checksum was taken ("flip"), or the stream ended after that chunk
without its trailer ("cut"). The receiver must refuse both (DATA_LOSS) and write nothing; the
router then has the decode node recompute the prompt. ``CorruptingFallbackSender`` does the same
on every transport the node sends over: shared memory and the raw TCP stream (through their own
senders, a socket wrapper doing the damage), then gRPC. The other fault a node can be told to
inject, engine steps that raise, is node/faults.py (both roles).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import grpc
from google.protobuf.message import DecodeError

from kv_transfer.grpc_transport import KV_CHANNEL_OPTIONS, PUSH_BLOCKS_PATH
from kv_transfer.layout import PoolLayout
from kv_transfer.shm_transport import ShmKVSender
from kv_transfer.tcp_transport import TcpKVSender
from kv_transfer.transport import FallbackKVSender, PushResult, TransferError
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
             block_hashes: Sequence[int], num_tokens: int, dest_block_ids: Sequence[int], token: bytes,
             skip_leading_blocks: int = 0, layers: range | None = None, timeout: float | None = None,
             **_) -> PushResult:
        layout = PoolLayout.of(pool)
        layers = range(layout.num_layers) if layers is None else layers  # a streamed push: some layers
        header = build_header(request_id=request_id, fingerprint=fingerprint, layout=layout,
                              dest_block_ids=dest_block_ids, block_hashes=list(block_hashes)[skip_leading_blocks:],
                              num_tokens=num_tokens, layers=layers, first_block_index=skip_leading_blocks,
                              checksum_algorithm=kv_pb2.CHECKSUM_ALGORITHM_CRC32,
                              token=token)  # the real token: the receiver's checksums must be what refuses it
        units = payload_units(pool, list(src_block_ids)[skip_leading_blocks:], layers)
        with self._lock:
            self.pushes += 1
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = channel(address, self._tls, KV_CHANNEL_OPTIONS)
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


# ---- the fast transports: the same damage on the TCP data stream and in shared memory
class _DamagingSocket:
    """A data-stream socket that damages the transfer it carries once ``armed``: a socket
    wrapper, so the sender's own code (kv_transfer/tcp_transport.py, shm_transport.py) builds
    every frame and checksum as it always does.

    TCP: the first block data after arming (a buffer of the pool, not a frame) goes out as a
    copy with one byte flipped; shared memory: when the first chunk frame goes out, one byte of
    that chunk in the shared buffer is flipped first (its checksum was taken before). "cut":
    the connection is closed instead of sending the trailer.
    """

    def __init__(self, sock, mode: str) -> None:
        self._sock = sock
        self.mode = mode
        self.armed = False
        self.shm_array = None  # the shared buffer (shm links)

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def sendmsg(self, buffers, *args):
        if not self.armed:
            return self._sock.sendmsg(buffers, *args)
        out = []
        for b in buffers:
            msg = _frame_message(b)
            if self.mode == "cut" and msg is not None and msg.WhichOneof("kind") == "trailer":
                for x in out:  # everything before the trailer reaches the receiver
                    self._sock.sendall(x)
                self.armed = False
                self._sock.close()
                raise ConnectionResetError("KV transfer cut before its trailer (kv fault)")
            out.append(self._damage(b, msg))
        return self._sock.sendmsg(out, *args)

    def _damage(self, buf, msg: kv_pb2.KVBlockMessage | None):
        if not self.armed or self.mode != "flip":
            return buf
        if not isinstance(getattr(buf, "obj", buf), bytes | bytearray):  # block data, not a frame
            if self.shm_array is None:  # TCP: the data itself
                data = bytearray(buf)
                data[len(data) // 2] ^= 0xFF
                self.armed = False
                return memoryview(bytes(data))
            return buf
        if msg is not None and msg.WhichOneof("kind") == "chunk" and self.shm_array is not None:
            c = msg.chunk
            self.shm_array[c.shm_offset + c.raw_bytes // 2] ^= 0xFF
            self.armed = False
        return buf


def _frame_message(buf) -> kv_pb2.KVBlockMessage | None:
    """The message of a whole frame (data_port.frame's bytes); None for block data or part of
    a frame."""
    whole = getattr(buf, "obj", buf)
    if not isinstance(whole, bytes | bytearray) or len(buf) != len(whole):
        return None
    try:
        return kv_pb2.KVBlockMessage.FromString(bytes(buf)[4:])
    except DecodeError:
        return None


class _Damaging:
    """What the TCP and shared-memory corrupting senders add to their transport."""

    mode = "flip"
    pushes = 0

    def _open(self, sock, header, clock):
        wrapped = _DamagingSocket(sock, self.mode)
        link = super()._open(wrapped, header, clock)
        wrapped.shm_array = getattr(link, "array", None)
        return link

    def _transfer(self, link, header, pool, send_ids, clock):
        with self._count_lock:
            self.pushes += 1
        link.sock.armed = True
        return super()._transfer(link, header, pool, send_ids, clock)


class CorruptingTcpSender(_Damaging, TcpKVSender):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self._count_lock = mode, threading.Lock()


class CorruptingShmSender(_Damaging, ShmKVSender):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self._count_lock = mode, threading.Lock()


class CorruptingFallbackSender(FallbackKVSender):
    """Every transport damaged: shared memory and the TCP stream first (without TLS, as the
    node's own sender), then gRPC; each damaged attempt is refused, counts as a transport
    failure, and the next transport is damaged too. ``pushes``: attempts over all of them;
    ``pushes_by_transport``: per transport."""

    def __init__(self, mode: str, tls: TlsFiles | None = None) -> None:
        if mode not in KV_FAULTS:
            raise ValueError(f"KV fault must be one of {KV_FAULTS}, got {mode!r}")
        fast = [CorruptingShmSender(mode), CorruptingTcpSender(mode)] if tls is None else []
        super().__init__(fast, CorruptingKVSender(mode, tls))
        self._senders = {**{s.scheme: s for s in fast}, "grpc": self._grpc}

    @property
    def pushes_by_transport(self) -> dict[str, int]:
        return {name: s.pushes for name, s in self._senders.items()}

    @property
    def pushes(self) -> int:
        return sum(self.pushes_by_transport.values())
