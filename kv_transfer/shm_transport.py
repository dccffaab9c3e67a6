"""KV blocks between two processes on one host through shared memory: ``ShmKVSender``.

The decode node's data server (receiver.TcpKVServer) is the receiver for both; it
advertises ``shm://<host key>/<host>:<port>`` before ``tcp://<host>:<port>``. The host key is
the kernel's boot id, so a sender on another machine skips the endpoint without trying it.

Per connection, the sender creates a buffer file under /dev/shm, the receiver maps it
read-only (KVAttach, which names the reservation of the transfer that opened the connection
and its token: the receiver opens no file for a peer without them) and the name is unlinked
at once (nothing is left behind if either process dies). A transfer is then the TCP stream's
frames without the bytes::

    sender:   gather chunk k's block-layers from the pool straight into the buffer (np.take,
              one copy), checksum it, send frame(chunk: seq, raw_bytes, checksum, shm_offset)
    receiver: checksum the chunk in the buffer, scatter it into the destination blocks

The sender gathers chunk k+1 while the receiver checks and scatters chunk k, on another core.
The whole payload has its own region of the buffer (no slot is reused within a transfer), so
the buffer is as large as the largest transfer, up to MAX_SHM_BYTES; larger transfers and any
failure to attach (another /dev/shm, as in separate containers) go to the next transport.

Measured against Ray's object store with numpy views in ``pdserve bench transfer``
(docs/benchmarks.md): see there for which is faster and why this one is kept.
"""
from __future__ import annotations

import mmap
import os
import secrets
import socket
from functools import cache

import grpc
import numpy as np
import torch

from kv_transfer.checksum import new_checksum
from kv_transfer.data_port import MAX_SHM_BYTES, SHM_DIR, SHM_PREFIX, frame, send_all
from kv_transfer.layout import PoolLayout
from kv_transfer.tcp_transport import (
    PROGRESS_TIMEOUT_S,
    STATUS_CODES,
    Clock,
    Link,
    TcpKVSender,
    parse_endpoint,
    read_reply,
)
from kv_transfer.tcp_transport import (
    SCHEME as TCP_SCHEME,
)
from kv_transfer.transport import PushResult, TransferError, TransportSkipped
from kv_transfer.wire import CHUNK_BYTES, unit_rows
from protos.pdserve.v1 import kv_pb2

SCHEME = "shm"
# Buffers start at this size and grow (a new buffer, attached again) to fit larger transfers.
MIN_BUFFER_BYTES = 16 << 20


@cache
def host_key() -> str:
    """This machine's identity for same-host checks: the kernel's boot id ("" if unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def shm_endpoint(host_port: str) -> str:
    """What a data server on ``host:port`` advertises for senders on this host."""
    return f"{SCHEME}://{host_key()}/{host_port}"


def parse_shm_endpoint(endpoint: str) -> tuple[str, str, int]:
    """``shm://key/host:port`` -> (key, host, port). ValueError otherwise."""
    prefix = f"{SCHEME}://"
    if not endpoint.startswith(prefix):
        raise ValueError(f"not a {SCHEME} endpoint: {endpoint!r}")
    key, sep, rest = endpoint[len(prefix):].partition("/")
    if not sep:
        raise ValueError(f"expected {prefix}host-key/host:port, got {endpoint!r}")
    host, port = parse_endpoint(f"{TCP_SCHEME}://{rest}")
    return key, host, port


def buffer_prefix() -> str:
    """Name prefix of this process's buffers under SHM_DIR (the pid tells whose a leftover is)."""
    return f"{SHM_PREFIX}{os.getpid()}x"


class _ShmLink(Link):
    def __init__(self, sock: socket.socket, size: int) -> None:
        super().__init__(sock)
        path = f"{SHM_DIR}/{buffer_prefix()}{secrets.token_hex(8)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.buffer = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.path, self.size = path, size
        self.array = np.frombuffer(self.buffer, dtype=np.uint8)  # [size]

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        self.array = None  # the array's buffer export must go before the map closes
        try:
            self.buffer.close()
        except BufferError:  # a view still alive (an exception's frame holds one); GC unmaps it
            pass
        super().close()


class ShmKVSender(TcpKVSender):
    """``push`` over ``shm://`` endpoints (same host). Same arguments and errors as
    TcpKVSender; UNAVAILABLE (so the next transport is tried) for another host, a transfer
    larger than ``max_buffer_bytes``, or a receiver that cannot map the buffer."""

    scheme = SCHEME

    def __init__(self, connect_timeout_s: float = 5.0, chunk_bytes: int = CHUNK_BYTES,
                 max_buffer_bytes: int = MAX_SHM_BYTES, progress_timeout_s: float | None = PROGRESS_TIMEOUT_S) -> None:
        super().__init__(connect_timeout_s, chunk_bytes, progress_timeout_s)
        self._max_buffer_bytes = max_buffer_bytes
        # Endpoints whose receiver could not map our buffers (same kernel, another /dev/shm, as
        # pods on one machine): not tried again, so each transfer does not pay a refused attach.
        self._unmappable: set[str] = set()

    def advertised(self) -> str:
        return f"{SCHEME}://{host_key()}/"

    def push(self, endpoint: str, pool: torch.Tensor, **blocks) -> PushResult:
        if endpoint in self._unmappable:
            raise TransportSkipped(f"{endpoint} cannot map this process's shared memory")
        try:
            return super().push(endpoint, pool, **blocks)
        except _AttachRefused:
            self._unmappable.add(endpoint)
            raise

    def _check(self, endpoint: str, header: kv_pb2.KVHeader) -> None:
        key, _, _ = parse_shm_endpoint(endpoint)
        if not key or key != host_key():
            raise TransportSkipped(f"{endpoint} is on another host")
        if header.payload_bytes > self._max_buffer_bytes:
            raise TransportSkipped(f"{header.payload_bytes} bytes exceed the shared buffer limit of "
                                   f"{self._max_buffer_bytes}")

    def _address(self, endpoint: str) -> tuple[str, int]:
        _, host, port = parse_shm_endpoint(endpoint)
        return host, port

    def _fits(self, link: _ShmLink, header: kv_pb2.KVHeader) -> bool:
        return link.size >= header.payload_bytes

    def _open(self, sock: socket.socket, header: kv_pb2.KVHeader, clock: Clock) -> _ShmLink:
        size = max(MIN_BUFFER_BYTES, 1 << (int(header.payload_bytes) - 1).bit_length())
        try:
            link = _ShmLink(sock, min(size, self._max_buffer_bytes))
        except BaseException:
            sock.close()
            raise
        try:
            attach = kv_pb2.KVAttach(path=link.path, size=link.size, request_id=header.request_id, token=header.token)
            send_all(sock, [frame(kv_pb2.KVBlockMessage(attach=attach))], clock.arm)
            clock.arm(sock)  # the receiver only maps the file before it answers
            reply = read_reply(sock)
        except BaseException:
            link.close()
            raise
        link.unlink()  # both ends hold the mapping; no name is left to clean up
        if reply.WhichOneof("kind") == "error":
            link.close()
            code = STATUS_CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN)
            if code in _REFUSALS:  # this transfer's reservation or token, not the mapping
                raise TransferError(code, reply.error.message)
            raise _AttachRefused(grpc.StatusCode.UNAVAILABLE, f"receiver could not attach shared memory: "
                                                              f"{reply.error.message}")
        return link

    def _unread_bytes(self, header: kv_pb2.KVHeader) -> int:
        # Frames are small and the socket holds all of them: the receiver may not have
        # checked any chunk yet when the trailer leaves.
        return header.payload_bytes

    def _transfer(self, link: _ShmLink, header: kv_pb2.KVHeader, pool: torch.Tensor, send_ids: list[int],
                  clock: Clock) -> kv_pb2.KVStreamReply:
        sock = link.sock
        layout = PoolLayout.of(pool)
        unit = layout.block_bytes
        # [num_layers * num_blocks, block_bytes]: unit (l, b) at row l * num_blocks + b
        rows = pool.view(-1).view(torch.uint8).view(-1, unit)
        rows_np = rows.numpy() if pool.device.type == "cpu" else None
        all_idx = unit_rows(header.layer_start, header.layer_count, send_ids, layout.num_blocks)  # [n_units]
        n_units = len(all_idx)
        per_chunk = max(1, self._chunk_bytes // unit)
        send_all(sock, [frame(kv_pb2.KVBlockMessage(header=header))], clock.arm)
        for seq, first in enumerate(range(0, n_units, per_chunk)):
            idx = all_idx[first : first + per_chunk]
            off, n = first * unit, len(idx) * unit
            out = link.array[off : off + n].reshape(len(idx), unit)
            if rows_np is not None:
                # the one gather, into shared memory ("clip": mode "raise" buffers `out`, 4x slower)
                np.take(rows_np, idx, axis=0, out=out, mode="clip")
            else:
                out[:] = rows.index_select(0, torch.from_numpy(idx).to(pool.device)).cpu().numpy()
            checksum = new_checksum(header.checksum_algorithm)
            checksum.update(out)
            chunk = kv_pb2.KVChunk(seq=seq, raw_bytes=n, checksum=checksum.value(), shm_offset=off)
            send_all(sock, [frame(kv_pb2.KVBlockMessage(chunk=chunk))], clock.arm)
        send_all(sock, [frame(kv_pb2.KVBlockMessage(trailer=kv_pb2.KVTrailer()))], clock.arm)
        return self._reply(sock, header, clock)


class _AttachRefused(TransferError):
    """The receiver could not map the sender's buffer."""


# Attach refusals that say nothing about whether the receiver can map this process's buffers:
# the endpoint stays in use for later transfers.
_REFUSALS = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED,
                       grpc.StatusCode.PERMISSION_DENIED})
