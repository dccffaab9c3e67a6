"""One connection of the data port on the receiving side (receiver.py): ``Connection``, its
buffers and attachments, and what a peer may hold before it proved it holds a reservation's
token (``UnprovenConnections``, ``frame_limit``).

Without TLS the data port is open to anyone who reaches it, and a connection costs a thread,
its buffers and whatever its first frame announces before any token is checked (256 connections
of a 1 MiB buffer and a 16 MiB frame each were about 4.3 GiB). A connection is *unproven* until
a token check passes on it (a transfer's header, a shared-memory or dist attach); then it is a
prefill node's kept connection and may idle between transfers. Until then:

- at most ``max_unproven`` such connections are open at once; more are closed on accept (the
  sender falls back to gRPC);
- each is shut down ``timeout_s`` after it was accepted, however it spends them (silent, a
  byte at a time, refused transfers one after another); real senders send their first frame
  as soon as they connect, and it is checked at once;
- frames are at most ``frame_limit(num_blocks)`` bytes (a header naming every block of the
  pool; nothing on the data port is larger), refused from their length alone, before a byte of
  them is read or a buffer for them is made;
- no chunk buffer exists yet (it is made on first use, as large as the chunks), and a refused
  transfer is read through 64 KiB.
"""
from __future__ import annotations

import logging
import mmap
import os
import socket
import stat
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kv_transfer.data_port import MAX_FRAME_BYTES, MAX_SHM_BYTES, SHM_DIR, SHM_PREFIX, read_frame, recv_exact
from kv_transfer.dist_group import GroupInbox
from kv_transfer.validate import KVValidationError
from protos.pdserve.v1 import kv_pb2

log = logging.getLogger(__name__)

# A receiver refuses larger chunks (they would grow its buffer without bound).
MAX_CHUNK_BYTES = 16 << 20
# Connections open at once that have not passed a token check.
MAX_UNPROVEN_CONNECTIONS = 32
# From accept to the first token check that passes.
PREAUTH_TIMEOUT_S = 5.0
# A header's bytes beyond its block lists (request id, fingerprint, shape, token; ~200 in
# practice), and per block: a dest block id (varint, <= 5 bytes) and a hash (fixed64, 8).
_HEADER_FIXED_BYTES = 4096
_HEADER_BYTES_PER_BLOCK = 13


def frame_limit(num_blocks: int, cap: int) -> int:
    """The largest frame a data port into a pool of ``num_blocks`` blocks reads (at most ``cap``):
    a header naming more blocks than the pool holds could never be valid."""
    return min(cap, _HEADER_FIXED_BYTES + _HEADER_BYTES_PER_BLOCK * num_blocks)


class UnprovenConnections:
    """The data port's unproven connections and their deadlines; a reaper thread shuts down
    each one still unproven at its deadline (its serving thread then sees the stream end).
    Thread-safe."""

    def __init__(self, max_unproven: int = MAX_UNPROVEN_CONNECTIONS, timeout_s: float = PREAUTH_TIMEOUT_S) -> None:
        self.max_unproven = max_unproven
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.refused = 0  # connections closed on accept: too many unproven ones open
        self.reaped = 0  # connections shut down at their deadline

    def admit(self, sock: socket.socket) -> bool:
        """Count ``sock`` as unproven from now; False when ``max_unproven`` are open already."""
        with self._lock:
            if len(self._deadlines) >= self.max_unproven:
                self.refused += 1
                return False
            self._deadlines[sock] = time.monotonic() + self.timeout_s
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="kv-preauth-reaper", daemon=True)
                self._reaper.start()
            return True

    def proven(self, sock: socket.socket) -> None:
        """``sock`` passed a token check (or closed): no longer counted, no deadline."""
        with self._lock:
            self._deadlines.pop(sock, None)

    def __len__(self) -> int:
        """Unproven connections open now."""
        with self._lock:
            return len(self._deadlines)

    def stop(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(5)

    def _reap(self) -> None:
        period = max(0.01, min(0.25, self.timeout_s / 4))
        while not self._stop.wait(period):
            now = time.monotonic()
            # Under the lock: a serving thread forgets its socket here (``proven``) before it
            # closes it, so the descriptor shut down is still that connection's.
            with self._lock:
                late = [s for s, deadline in self._deadlines.items() if deadline <= now]
                for s in late:
                    del self._deadlines[s]
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # its peer reset it meanwhile
            self.reaped += len(late)
            if late:
                log.info("KV data port: %d peer(s) sent no valid token within %.3g s of connecting; closed",
                         len(late), self.timeout_s)


class Connection:
    """One data connection on the receiving side: its socket, the reused buffer chunks are
    read into (made on first use, as large as the chunks: nothing before a token check), and
    the sender's shared-memory buffer once attached (read-only). ``prove()`` once a token
    check passed on it: ``on_proven`` lifts the bounds above."""

    def __init__(self, sock: socket.socket, frame_limit: int = MAX_FRAME_BYTES,
                 on_proven: Callable[[], None] = lambda: None) -> None:
        self.sock = sock
        self.frame_limit = frame_limit
        self._on_proven = on_proven
        self.authenticated = False
        self._staging = bytearray()
        self._shm: mmap.mmap | None = None
        self._shm_array: np.ndarray | None = None  # [size] uint8 over _shm
        self.group: GroupInbox | None = None  # the sender's process group once attached (dist)

    def prove(self) -> None:
        if not self.authenticated:
            self.authenticated = True
            self._on_proven()

    def attach(self, attach: kv_pb2.KVAttach) -> kv_pb2.KVStreamReply:
        """Map the sender's buffer named in ``attach`` (replacing any earlier one)."""
        path = attach.path
        name = os.path.basename(path)
        if os.path.dirname(path) != SHM_DIR or not name.startswith(SHM_PREFIX) or not name[len(SHM_PREFIX):].isalnum():
            return error_reply(grpc.StatusCode.INVALID_ARGUMENT,
                          f"attach path: got {path!r}, expected {SHM_DIR}/{SHM_PREFIX}<alphanumeric>")
        if not 0 < attach.size <= MAX_SHM_BYTES:
            return error_reply(grpc.StatusCode.INVALID_ARGUMENT, f"attach size: got {attach.size}, expected (0, {MAX_SHM_BYTES}]")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as err:  # another host, or another /dev/shm (container): use TCP
            return error_reply(grpc.StatusCode.UNAVAILABLE, f"attach: cannot open {path!r}: {err.strerror}")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != attach.size:
                return error_reply(grpc.StatusCode.INVALID_ARGUMENT,
                              f"attach: {path!r} is not a regular file of {attach.size} bytes")
            shm = mmap.mmap(fd, attach.size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.close_shm()
        self._shm, self._shm_array = shm, np.frombuffer(shm, dtype=np.uint8)
        return kv_pb2.KVStreamReply(ok=kv_pb2.PushBlocksResponse())

    def chunk_data(self, chunk: kv_pb2.KVChunk, next_n: int = 0) -> np.ndarray:
        n = chunk.raw_bytes
        if chunk.HasField("shm_offset"):
            off = chunk.shm_offset
            if self._shm_array is None or off + n > len(self._shm_array):
                size = 0 if self._shm_array is None else len(self._shm_array)
                raise Desync(f"chunk {chunk.seq} shm_offset: [{off}, {off + n}) outside the attached "
                              f"buffer of {size} bytes")
            return self._shm_array[off : off + n]
        if chunk.over_group:  # one receive from the sender's group
            if self.group is None:
                raise Desync(f"chunk {chunk.seq} over_group on a connection without a process group")
            return self.group.take(n, next_n)
        if len(self._staging) < n:
            self._staging = bytearray(n)
        if not recv_exact(self.sock, memoryview(self._staging)[:n]):
            raise Desync("stream ended inside a chunk")
        return np.frombuffer(self._staging, dtype=np.uint8, count=n)

    def drain(self) -> bool:
        """Read and drop the rest of a refused transfer up to its trailer; False when the
        stream does not parse (then the connection is closed)."""
        try:
            if not self._staging:  # a stranger's refused transfer is read through 64 KiB
                self._staging = bytearray(64 << 10)
            while True:
                body = read_frame(self.sock, self.frame_limit)
                if body is None:
                    return False
                msg = parse(body)
                kind = msg.WhichOneof("kind")
                if kind == "trailer":
                    return True
                if kind != "chunk" or msg.chunk.raw_bytes > MAX_CHUNK_BYTES:
                    return False
                if msg.chunk.HasField("shm_offset"):
                    continue  # nothing on the socket
                if msg.chunk.over_group:  # received and dropped, so the sender's send completes
                    self.chunk_data(msg.chunk)
                    continue
                left = msg.chunk.raw_bytes
                view = memoryview(self._staging)
                while left:
                    part = view[: min(left, len(view))]
                    if not recv_exact(self.sock, part):
                        return False
                    left -= len(part)
        except (OSError, KVValidationError):
            return False

    def close_shm(self) -> None:
        if self._shm is not None:
            self._shm_array = None  # the array's buffer export must go before the map closes
            try:
                self._shm.close()
            except BufferError:  # a view still alive (a failed chunk's frame); the GC frees it
                pass
            self._shm = None

    def close(self) -> None:
        self.close_shm()
        if self.group is not None:
            self.group.close()
        self.sock.close()


class Desync(KVValidationError):
    """The stream broke its framing: its remaining bytes cannot be found, so the connection ends."""


def parse(body: bytes) -> kv_pb2.KVBlockMessage:
    try:
        return kv_pb2.KVBlockMessage.FromString(body)
    except DecodeError as err:
        raise Desync(f"frame: not a KVBlockMessage ({err})") from None


def error_reply(code: grpc.StatusCode, message: str) -> kv_pb2.KVStreamReply:
    return kv_pb2.KVStreamReply(error=kv_pb2.KVStreamError(code=code.value[0], message=message))
