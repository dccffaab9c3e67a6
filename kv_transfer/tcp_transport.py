"""KV blocks over a raw TCP data stream beside gRPC (gRPC stays the control plane), as
Mooncake's transfer engine does: ``TcpKVSender`` (prefill node) and ``TcpKVServer`` (decode
node, advertised as ``tcp://host:port`` in its index entry and its reservations).

Why: grpcio moves a 3 MiB transfer at about a quarter of what the same socket moves, and pays
about 1 ms per call before a byte moves (docs/benchmarks.md, transfer). Here a transfer is
framed protobufs plus raw bytes on a connection that is kept open and reused::

    frame := uint32 big-endian length, then that many bytes of protobuf
    sender -> frame(KVBlockMessage header)
              { frame(KVBlockMessage chunk: seq, raw_bytes, checksum)  raw_bytes bytes }*
              frame(KVBlockMessage trailer)
    sender <- frame(KVStreamReply: ok PushBlocksResponse | error code, message)

The payload order is wire.py's (layer-major units, one block-layer each). Copies: the sender
hands the pool's block views to one ``sendmsg`` per chunk (the kernel gathers them: no staging
buffer); on a CPU pool the receiver hands the chunk's destination blocks to ``recvmsg_into``
(the kernel scatters into them: no staging buffer either; consecutive blocks merge into one
view) and checksums them there. A device pool still reads each chunk into a small reused
buffer, checks it, then copies it to the device.

Integrity: the header (request, reservation, block ids, shape, dtype, fingerprint) is
validated (validate.py) before any chunk is read, and each chunk's size against it before
its bytes are read, so bytes only ever land in blocks reserved for this transfer; every
chunk's checksum is checked before the next chunk is read and before the transfer is
acknowledged. A transfer that fails part-way (or whose chunk fails its checksum) has written
only into blocks reserved for it, which no request can read until Decode takes the complete
reservation; they stay reserved (a retry over gRPC overwrites them all) and are freed with
the reservation (ReleaseReservation, a recompute, or its lease).
"""
from __future__ import annotations

import logging
import mmap
import os
import socket
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError

from kv_transfer.checksum import new_checksum
from kv_transfer.grpc_transport import ReceivedBlocks, _status
from kv_transfer.layout import PoolLayout
from kv_transfer.transport import PushResult, TransferError
from kv_transfer.validate import (
    KVDataLossError,
    KVNotReservedError,
    KVValidationError,
    Reservation,
    validate_header,
)
from kv_transfer.wire import build_header, payload_units, unit_rows
from protos.pdserve.v1 import kv_pb2

log = logging.getLogger(__name__)

SCHEME = "tcp"
# Bytes per chunk: large enough that per-chunk work (a frame, a checksum call, a scatter) is
# small next to moving it, small enough that the receive buffer stays cache-warm.
CHUNK_BYTES = 1 << 20
# A receiver refuses larger chunks (they would grow its buffer without bound).
MAX_CHUNK_BYTES = 16 << 20
# Frames are protobuf headers (~13 bytes per block) and small messages.
MAX_FRAME_BYTES = 16 << 20
# sendmsg takes at most IOV_MAX (1024 on Linux) buffers per call.
_MAX_IOV = 512
# Idle connections kept per endpoint (a node pushes from several threads at once).
MAX_IDLE_PER_ENDPOINT = 4
_SOCKET_BUFFER_BYTES = 4 << 20
# Receiver: a transfer with no progress for this long fails (its reservation can be freed).
STALL_TIMEOUT_S = 30.0
# Sender: a push on which no byte moved for this long fails with DEADLINE_EXCEEDED and falls back
# to the next transport, so a receiver that accepted the connection and stopped reading (a
# wedged process, an acceptor that never serves its backlog) holds the sender thread, the
# prefill node's blocks and the decode node's reservation for this long, not the push's whole
# deadline. A healthy receiver never pauses this long: it reads ~1 MiB chunks back to back.
PROGRESS_TIMEOUT_S = 5.0
# Sender, after its last byte: the receiver still checks and scatters what it had not read yet
# (at most the socket buffers' worth; shm: the whole payload) before it answers, so the wait
# for the reply gets this much per such byte beyond the progress timeout: 50 MB/s, about 80x
# below the slowest receiver measured (docs/benchmarks.md, transfer).
REPLY_SECONDS_PER_BYTE = 1 / 50e6
# Receiver: connections served at once (a thread each); more are closed at once.
MAX_CONNECTIONS = 256
# Shared-memory buffers senders on the same host attach (shm_transport.py): where they live,
# their name prefix, and the most a receiver maps.
SHM_DIR = "/dev/shm"
SHM_PREFIX = "pdserve-kv-"
MAX_SHM_BYTES = 1 << 30
_LEN = struct.Struct("!I")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` (IPv6 in brackets) -> (host, port). ValueError otherwise."""
    prefix = f"{SCHEME}://"
    if not endpoint.startswith(prefix):
        raise ValueError(f"not a {SCHEME} endpoint: {endpoint!r}")
    host, sep, port = endpoint[len(prefix):].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected {prefix}host:port, got {endpoint!r}")
    return host.strip("[]"), int(port)


def tune_socket(sock: socket.socket) -> None:
    """The options every data connection gets (both ends): no Nagle delay, keepalive, 4 MiB
    socket buffers. The transfer bench gives its raw-socket ceiling the same."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # idle kept connections to a dead peer end
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER_BYTES)


def frame(message) -> bytes:
    """One frame: the message's length (uint32, big-endian) and its encoding."""
    body = message.SerializeToString()
    return _LEN.pack(len(body)) + body


def send_all(sock: socket.socket, buffers: Sequence, clock: Clock | None = None) -> None:
    """sendmsg until every buffer is out (a call may send part of them); ``clock`` limits
    each call's wait."""
    views = deque(memoryview(b).cast("B") for b in buffers)
    while views:
        batch = [views[i] for i in range(min(len(views), _MAX_IOV))]
        if clock is not None:
            clock.arm(sock)
        _advance(views, sock.sendmsg(batch))
        while views and not len(views[0]):
            views.popleft()


def _advance(views: deque, n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (a vectored call moved that many)."""
    while n:
        head = views[0]
        if n >= len(head):
            n -= len(head)
            views.popleft()
        else:
            views[0] = head[n:]
            n = 0


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False if the peer closed before the first byte, ConnectionError if it
    closed part-way."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
        got += n
    return True


def _parse(body: bytes) -> kv_pb2.KVBlockMessage:
    try:
        return kv_pb2.KVBlockMessage.FromString(body)
    except DecodeError as err:
        raise _Desync(f"frame: not a KVBlockMessage ({err})") from None


def _read_frame(sock: socket.socket) -> bytes | None:
    """One frame's body; None on a clean close before it."""
    head = bytearray(_LEN.size)
    if not _recv_exact(sock, memoryview(head)):
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME_BYTES:
        raise KVValidationError(f"frame length: got {n}, expected <= {MAX_FRAME_BYTES}")
    body = bytearray(n)
    if n and not _recv_exact(sock, memoryview(body)):
        raise ConnectionError("peer closed inside a frame")
    return bytes(body)


# ---------------------------------------------------------------------------- sender


class Clock:
    """A push's time limits on its socket: its deadline (``timeout`` seconds from the start,
    None: none) and at most ``progress_s`` (None: no limit) waiting for any one send or
    receive, i.e. without a byte moving. ``arm`` before every blocking call; after a
    TimeoutError, ``why`` says which limit it was."""

    def __init__(self, timeout: float | None, progress_s: float | None) -> None:
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._progress_s = progress_s
        self.why = "timed out"

    def arm(self, sock: socket.socket, wait_s: float | None = None) -> None:
        """Let the next call on ``sock`` wait ``wait_s`` (default: the progress timeout), never
        past the deadline; TimeoutError when the deadline has passed."""
        wait = self._progress_s if wait_s is None else wait_s
        self.why = "timed out" if wait is None else f"no progress for {wait:.3g} s"
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if wait is None or left <= wait:
                self.why = "past the push's deadline"
                if left <= 0:
                    raise TimeoutError(self.why)
                wait = left
        sock.settimeout(wait)

    def limit(self, seconds: float) -> float:
        """``seconds``, or less if the deadline comes first (for connecting)."""
        self.why = "connect timed out"
        return seconds if self._deadline is None else max(0.001, min(seconds, self._deadline - time.monotonic()))


class Link:
    """A sender's open connection to one endpoint (shm_transport adds its buffer)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def close(self) -> None:
        self.sock.close()


class TcpKVSender:
    """``push`` over ``tcp://`` endpoints, with connections kept open per endpoint and reused
    (connection setup stays off the per-request path). Thread-safe: concurrent pushes to one
    endpoint use separate connections."""

    scheme = SCHEME

    def __init__(self, connect_timeout_s: float = 5.0, chunk_bytes: int = CHUNK_BYTES,
                 progress_timeout_s: float | None = PROGRESS_TIMEOUT_S) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._chunk_bytes = chunk_bytes
        self._progress_timeout_s = progress_timeout_s
        self._idle: dict[str, list[Link]] = {}
        self._lock = threading.Lock()  # guards _idle

    def push(
        self, endpoint: str, pool: torch.Tensor, *, request_id: str, fingerprint: str,
        src_block_ids: Sequence[int], block_hashes: Sequence[int], num_tokens: int,
        dest_block_ids: Sequence[int], skip_leading_blocks: int = 0, layers: range | None = None,
        timeout: float | None = None, checksum_algorithm: int = kv_pb2.CHECKSUM_ALGORITHM_XXH3_64,
    ) -> PushResult:
        """Send ``src_block_ids[skip_leading_blocks:]`` of ``pool`` into ``dest_block_ids`` at
        ``endpoint`` (same arguments as grpc_transport.push_blocks). Raises TransferError with
        the receiver's code, UNAVAILABLE when it cannot be reached or the stream broke, or
        DEADLINE_EXCEEDED past ``timeout`` (the whole push) or when no byte moved for the
        progress timeout; ValueError when the blocks do not fit the reservation."""
        layout = PoolLayout.of(pool)
        send_ids = list(src_block_ids)[skip_leading_blocks:]
        if len(send_ids) != len(dest_block_ids):
            raise ValueError(f"{len(send_ids)} blocks to send after skipping {skip_leading_blocks}, "
                             f"but {len(dest_block_ids)} dest_block_ids")
        layers = range(layout.num_layers) if layers is None else layers
        header = build_header(
            request_id=request_id, fingerprint=fingerprint, layout=layout, dest_block_ids=dest_block_ids,
            block_hashes=list(block_hashes)[skip_leading_blocks:], num_tokens=num_tokens, layers=layers,
            first_block_index=skip_leading_blocks, checksum_algorithm=checksum_algorithm,
        )
        self._check(endpoint, header)
        clock = Clock(timeout, self._progress_timeout_s)
        reused, link = self._take(endpoint, header, clock)
        try:
            reply = self._transfer(link, header, pool, send_ids, clock)
        except (ConnectionError, OSError) as err:
            link.close()
            if not reused or isinstance(err, TimeoutError):
                raise self._unavailable(endpoint, err, clock) from None
            # A kept connection the receiver closed meanwhile (restart, idle close): once more
            # on a fresh one; the receiver forgot the broken stream, and a rewrite is whole.
            _, link = self._take(endpoint, header, clock, fresh=True)
            try:
                reply = self._transfer(link, header, pool, send_ids, clock)
            except (ConnectionError, OSError) as err2:
                link.close()
                raise self._unavailable(endpoint, err2, clock) from None
        except BaseException:
            link.close()
            raise
        self._give_back(endpoint, link)
        if reply.WhichOneof("kind") == "error":
            code = _CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN)
            raise TransferError(code, reply.error.message)
        return PushResult(reply.ok.blocks_written, reply.ok.bytes_written)

    def close(self) -> None:
        with self._lock:
            links = [k for lst in self._idle.values() for k in lst]
            self._idle.clear()
        for k in links:
            k.close()

    def advertised(self) -> str:
        return f"{self.scheme}://"

    # ---- what a transport on this stream changes (shm_transport.ShmKVSender)
    def _check(self, endpoint: str, header: kv_pb2.KVHeader) -> None:
        """Raise TransferError when this transfer cannot go to ``endpoint`` at all."""

    def _address(self, endpoint: str) -> tuple[str, int]:
        return parse_endpoint(endpoint)

    def _open(self, sock: socket.socket, header: kv_pb2.KVHeader, clock: Clock) -> Link:
        return Link(sock)

    def _fits(self, link: Link, header: kv_pb2.KVHeader) -> bool:
        return True

    def _unread_bytes(self, header: kv_pb2.KVHeader) -> int:
        """The most payload the receiver may still have to check and scatter once the last
        byte is sent: what the two socket buffers hold (the kernel doubles each one set)."""
        return min(header.payload_bytes, 4 * _SOCKET_BUFFER_BYTES)

    def _transfer(self, link: Link, header: kv_pb2.KVHeader, pool: torch.Tensor, send_ids: list[int],
                  clock: Clock) -> kv_pb2.KVStreamReply:
        sock = link.sock
        units = payload_units(pool, send_ids, range(header.layer_start, header.layer_start + header.layer_count))
        unit_bytes = units[0].nbytes
        per_chunk = max(1, min(_MAX_IOV - 2, self._chunk_bytes // unit_bytes))
        pending = [frame(kv_pb2.KVBlockMessage(header=header))]
        for seq, start in enumerate(range(0, len(units), per_chunk)):
            part = units[start : start + per_chunk]
            checksum = new_checksum(header.checksum_algorithm)
            for u in part:
                checksum.update(u)
            chunk = kv_pb2.KVChunk(seq=seq, raw_bytes=len(part) * unit_bytes, checksum=checksum.value())
            pending += [frame(kv_pb2.KVBlockMessage(chunk=chunk)), *part]
            if start + per_chunk >= len(units):  # the last chunk carries the trailer along
                pending.append(frame(kv_pb2.KVBlockMessage(trailer=kv_pb2.KVTrailer())))
            send_all(sock, pending, clock)
            pending = []
        return self._reply(sock, header, clock)

    def _reply(self, sock: socket.socket, header: kv_pb2.KVHeader, clock: Clock) -> kv_pb2.KVStreamReply:
        if self._progress_timeout_s is None:
            clock.arm(sock)
        else:
            clock.arm(sock, self._progress_timeout_s + self._unread_bytes(header) * REPLY_SECONDS_PER_BYTE)
        return read_reply(sock)

    # ---- connections
    def _take(self, endpoint: str, header: kv_pb2.KVHeader, clock: Clock,
              fresh: bool = False) -> tuple[bool, Link]:
        if not fresh:
            with self._lock:
                idle = self._idle.get(endpoint, [])
                for i, link in enumerate(idle):
                    if self._fits(link, header):
                        return True, idle.pop(i)
        host, port = self._address(endpoint)
        try:
            sock = socket.create_connection((host, port), timeout=clock.limit(self._connect_timeout_s))
            tune_socket(sock)
            return False, self._open(sock, header, clock)
        except OSError as err:
            raise self._unavailable(endpoint, err, clock) from None

    def _give_back(self, endpoint: str, link: Link) -> None:
        with self._lock:
            idle = self._idle.setdefault(endpoint, [])
            if len(idle) < MAX_IDLE_PER_ENDPOINT:
                idle.append(link)
                return
        link.close()

    @staticmethod
    def _unavailable(endpoint: str, err: BaseException, clock: Clock | None = None) -> TransferError:
        if isinstance(err, TimeoutError):
            why = clock.why if clock is not None else "timed out"
            return TransferError(grpc.StatusCode.DEADLINE_EXCEEDED, f"data stream to {endpoint}: {why}")
        return TransferError(grpc.StatusCode.UNAVAILABLE, f"data stream to {endpoint}: {err!r}")


def read_reply(sock: socket.socket) -> kv_pb2.KVStreamReply:
    """The receiver's answer to a transfer (or an attach). ConnectionError if none came."""
    try:
        body = _read_frame(sock)
        if body is None:
            raise ConnectionError("receiver closed the connection without a reply")
        return kv_pb2.KVStreamReply.FromString(body)
    except (KVValidationError, DecodeError) as err:  # not a pdserve receiver, or out of step
        raise ConnectionError(f"garbled reply from the receiver: {err}") from None


_CODES = {c.value[0]: c for c in grpc.StatusCode}


# ---------------------------------------------------------------------------- receiver


class TcpKVServer:
    """Receives transfers into one KV pool on a listening TCP socket; one thread per
    connection, connections serve transfer after transfer.

    The hooks are the decode node's, as for KVReceiver: ``reservation_for(rid)`` what a
    transfer is checked against; ``begin_push(rid)`` (False: refuse, no reservation) and
    ``end_push(rid)`` bracket every transfer that got past its header, so the reservation's
    blocks are not released while this server may write into them; ``on_received`` runs after
    a complete transfer is in the pool, before the sender is answered; ``on_outcome(ok,
    payload_bytes, seconds)`` once per transfer, refused ones included (metrics).
    """

    def __init__(
        self, pool: torch.Tensor, fingerprint: str, *,
        on_received: Callable[[ReceivedBlocks], None],
        reservation_for: Callable[[str], Reservation | None],
        begin_push: Callable[[str], bool] = lambda rid: True,
        end_push: Callable[[str], None] = lambda rid: None,
        on_outcome: Callable[[bool, int, float], None] = lambda ok, nbytes, seconds: None,
        host: str = "127.0.0.1", port: int = 0, stall_timeout_s: float = STALL_TIMEOUT_S,
    ) -> None:
        self._stall_timeout_s = stall_timeout_s
        self._pool = pool
        self._layout = PoolLayout.of(pool)
        # [num_layers * num_blocks, block_bytes]: one block-layer ("unit") per row, unit (l, b)
        # at row l * num_blocks + b. numpy's indexed assignment for a CPU pool (torch's
        # index_put_ on uint8 rows is ~200x slower there), index_copy_ on a device.
        rows = pool.view(-1).view(torch.uint8).view(-1, self._layout.block_bytes)
        self._rows = rows.numpy() if pool.device.type == "cpu" else rows
        self._fingerprint = fingerprint
        self._on_received = on_received
        self._reservation_for = reservation_for
        self._begin_push = begin_push
        self._end_push = end_push
        self._on_outcome = on_outcome
        self._bind = (host, port)
        self._listener: socket.socket | None = None
        self.port: int | None = None  # the bound port, once started
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()  # guards _conns, _stopped
        self._stopped = False
        self._acceptor: threading.Thread | None = None
        self.connections_accepted = 0  # senders keep connections open: this grows per sender thread

    def start(self) -> int:
        """Bind and accept; returns the bound port."""
        self._listener = socket.create_server(self._bind, backlog=64)
        self.port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name=f"kv-tcp-{self.port}", daemon=True)
        self._acceptor.start()
        return self.port

    def stop(self) -> None:
        """Close the listener and every connection; a transfer in progress fails (its sender
        sees UNAVAILABLE and falls back)."""
        with self._lock:
            self._stopped = True
            conns, self._conns = list(self._conns), set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._acceptor is not None and self._acceptor.is_alive():
            self._acceptor.join(5)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                if self._stopped:
                    conn.close()
                    return
                if len(self._conns) >= MAX_CONNECTIONS:  # the sender falls back to gRPC
                    log.warning("KV data port %s: %d connections open, refusing another", self.port,
                                len(self._conns))
                    conn.close()
                    continue
                self._conns.add(conn)
                self.connections_accepted += 1
            tune_socket(conn)
            threading.Thread(target=self._serve, args=(conn,), name=f"kv-tcp-conn-{self.port}", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = _Connection(sock)
        try:
            while True:
                sock.settimeout(None)  # a kept connection may idle between transfers
                body = _read_frame(sock)
                if body is None:
                    return
                # A sender that stalls mid-transfer must not pin its reservation (no release
                # while a push is in flight): no progress for stall_timeout_s fails the transfer.
                sock.settimeout(self._stall_timeout_s)
                try:
                    msg = _parse(body)
                except _Desync as err:
                    reply, keep = _error(grpc.StatusCode.INVALID_ARGUMENT, str(err)), False
                else:
                    if msg.WhichOneof("kind") == "attach":
                        reply, keep = conn.attach(msg.attach), True
                    else:
                        reply, keep = self._one(conn, msg)
                send_all(sock, [frame(reply)])
                if not keep:
                    return
        except (OSError, KVValidationError) as err:  # the sender went away or spoke garbage
            log.debug("KV data connection closed: %r", err)
        finally:
            with self._lock:
                self._conns.discard(sock)
            conn.close()

    def _one(self, conn: _Connection, msg: kv_pb2.KVBlockMessage) -> tuple[kv_pb2.KVStreamReply, bool]:
        """One transfer whose first message is ``msg`` -> (reply, keep the connection). A
        refused transfer's remaining frames are read and dropped, so the sender gets its reply
        and the connection stays in step."""
        began, ok, t0 = None, False, time.monotonic()
        nbytes = 0
        try:
            if msg.WhichOneof("kind") != "header":
                raise KVValidationError(f"first message: got {msg.WhichOneof('kind')}, expected header")
            header = msg.header
            if not self._begin_push(header.request_id):
                raise KVNotReservedError(f"request_id: no reservation for {header.request_id!r}")
            began = header.request_id
            reservation = self._reservation_for(header.request_id)
            if reservation is None:
                raise KVNotReservedError(f"request_id: no reservation for {header.request_id!r}")
            validate_header(header, self._layout, self._fingerprint, reservation)
            self._receive(conn, header)
            received = ReceivedBlocks(
                request_id=header.request_id,
                layers=range(header.layer_start, header.layer_start + header.layer_count),
                first_block_index=header.first_block_index, block_ids=tuple(header.dest_block_ids),
                block_hashes=tuple(header.block_hashes), num_tokens=header.num_tokens,
            )
            try:
                self._on_received(received)
            except Exception as err:  # the sender must learn the blocks were not taken
                return _error(grpc.StatusCode.INTERNAL, f"on_received failed: {err!r}"), True
            ok, nbytes = True, header.payload_bytes
            written = kv_pb2.PushBlocksResponse(blocks_written=len(received.block_ids), bytes_written=nbytes)
            return kv_pb2.KVStreamReply(ok=written), True
        except KVValidationError as err:
            keep = conn.drain() if not isinstance(err, _Desync) else False
            return _error(_status(err), str(err)), keep
        finally:
            if began is not None:
                self._end_push(began)
            self._on_outcome(ok, nbytes, time.monotonic() - t0)

    def _receive(self, conn: _Connection, header: kv_pb2.KVHeader) -> None:
        """Chunks and trailer of a validated header; each chunk checked, then scattered."""
        unit = self._layout.block_bytes
        # The pool row of every unit, once per transfer (bounded: the header was validated
        # against the reservation); a chunk's rows are a slice of it.
        all_rows = unit_rows(header.layer_start, header.layer_count, header.dest_block_ids, self._layout.num_blocks)
        received, seq = 0, 0
        while True:
            body = _read_frame(conn.sock)
            if body is None:
                raise _Desync(f"stream ended without trailer after {received} of {header.payload_bytes} payload bytes")
            msg = _parse(body)
            kind = msg.WhichOneof("kind")
            if kind == "trailer":
                if received != header.payload_bytes:
                    raise KVDataLossError(f"payload bytes: got {received}, header declared {header.payload_bytes}")
                return
            if kind != "chunk":
                raise _Desync(f"message after header: got {kind}, expected chunk or trailer")
            chunk, n = msg.chunk, msg.chunk.raw_bytes
            if chunk.seq != seq:
                raise _Desync(f"chunk seq: got {chunk.seq}, expected {seq}")
            if n == 0 or n % unit or n > MAX_CHUNK_BYTES or received + n > header.payload_bytes:
                raise _Desync(f"chunk {seq} raw_bytes: got {n}, expected a multiple of {unit} bytes, "
                              f"<= {MAX_CHUNK_BYTES}, within payload_bytes={header.payload_bytes} "
                              f"({received} received)")
            # Units [first, first + k) of the payload (wire.py's order).
            first, k = received // unit, n // unit
            rows = all_rows[first : first + k]
            checksum = new_checksum(header.checksum_algorithm)
            if isinstance(self._rows, np.ndarray) and not chunk.HasField("shm_offset"):
                # Straight from the socket into the reserved blocks (one readv per call) and
                # checked there: the staging buffer's extra pass was about a quarter of a
                # chunk's time. A chunk that fails its checksum has written only into blocks
                # reserved for this transfer, as a transfer that fails part-way always has.
                views = _row_views(self._rows, rows)
                _recv_into_views(conn.sock, views)
                for v in views:
                    checksum.update(v)
                _check_chunk(seq, checksum.value(), chunk.checksum)
            else:
                data = conn.chunk_data(chunk)  # [n] uint8, from the shared buffer or staged
                checksum.update(data)
                _check_chunk(seq, checksum.value(), chunk.checksum)
                src = data.reshape(k, unit)
                if isinstance(self._rows, np.ndarray):
                    self._rows[rows] = src
                else:  # [k, block_bytes] to the pool's device, then one scatter there
                    self._rows.index_copy_(0, torch.from_numpy(rows).to(self._rows.device),
                                           torch.from_numpy(src).to(self._rows.device))
            received += n
            seq += 1


def _check_chunk(seq: int, computed: int, declared: int) -> None:
    if computed != declared:
        raise KVDataLossError(f"chunk {seq} checksum: computed {computed:#x}, frame says {declared:#x}")


def _row_views(rows: np.ndarray, idx: np.ndarray) -> list[memoryview]:
    """Writable byte views of ``rows[idx]`` in order, consecutive rows merged into one view
    (``rows``: [num_rows, row_bytes] uint8; ``idx``: [k] row numbers)."""
    # Runs of consecutive rows: a new run wherever the next row is not this row + 1.
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], breaks)).tolist()
    ends = np.concatenate((breaks, [len(idx)])).tolist()
    return [memoryview(rows[idx[a] : idx[a] + (b - a)]).cast("B") for a, b in zip(starts, ends)]


def _recv_into_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view in order from ``sock`` (readv: the kernel scatters into them)."""
    pending = deque(views)
    while pending:
        n = sock.recvmsg_into([pending[i] for i in range(min(len(pending), _MAX_IOV))])[0]
        if n == 0:
            raise _Desync("stream ended inside a chunk")
        _advance(pending, n)


class _Connection:
    """One data connection on the receiving side: its socket, the reused buffer chunks are
    read into, and the sender's shared-memory buffer once attached (read-only)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._staging = bytearray(CHUNK_BYTES)
        self._shm: mmap.mmap | None = None
        self._shm_array: np.ndarray | None = None  # [size] uint8 over _shm

    def attach(self, attach: kv_pb2.KVAttach) -> kv_pb2.KVStreamReply:
        """Map the sender's buffer named in ``attach`` (replacing any earlier one)."""
        path = attach.path
        name = os.path.basename(path)
        if os.path.dirname(path) != SHM_DIR or not name.startswith(SHM_PREFIX) or not name[len(SHM_PREFIX):].isalnum():
            return _error(grpc.StatusCode.INVALID_ARGUMENT,
                          f"attach path: got {path!r}, expected {SHM_DIR}/{SHM_PREFIX}<alphanumeric>")
        if not 0 < attach.size <= MAX_SHM_BYTES:
            return _error(grpc.StatusCode.INVALID_ARGUMENT, f"attach size: got {attach.size}, expected (0, {MAX_SHM_BYTES}]")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as err:  # another host, or another /dev/shm (container): use TCP
            return _error(grpc.StatusCode.UNAVAILABLE, f"attach: cannot open {path!r}: {err.strerror}")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != attach.size:
                return _error(grpc.StatusCode.INVALID_ARGUMENT,
                              f"attach: {path!r} is not a regular file of {attach.size} bytes")
            shm = mmap.mmap(fd, attach.size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.close_shm()
        self._shm, self._shm_array = shm, np.frombuffer(shm, dtype=np.uint8)
        return kv_pb2.KVStreamReply(ok=kv_pb2.PushBlocksResponse())

    def chunk_data(self, chunk: kv_pb2.KVChunk) -> np.ndarray:
        n = chunk.raw_bytes
        if chunk.HasField("shm_offset"):
            off = chunk.shm_offset
            if self._shm_array is None or off + n > len(self._shm_array):
                size = 0 if self._shm_array is None else len(self._shm_array)
                raise _Desync(f"chunk {chunk.seq} shm_offset: [{off}, {off + n}) outside the attached "
                              f"buffer of {size} bytes")
            return self._shm_array[off : off + n]
        if len(self._staging) < n:
            self._staging = bytearray(n)
        if not _recv_exact(self.sock, memoryview(self._staging)[:n]):
            raise _Desync("stream ended inside a chunk")
        return np.frombuffer(self._staging, dtype=np.uint8, count=n)

    def drain(self) -> bool:
        """Read and drop the rest of a refused transfer up to its trailer; False when the
        stream does not parse (then the connection is closed)."""
        try:
            while True:
                body = _read_frame(self.sock)
                if body is None:
                    return False
                msg = _parse(body)
                kind = msg.WhichOneof("kind")
                if kind == "trailer":
                    return True
                if kind != "chunk" or msg.chunk.raw_bytes > MAX_CHUNK_BYTES:
                    return False
                if msg.chunk.HasField("shm_offset"):
                    continue  # nothing on the socket
                left = msg.chunk.raw_bytes
                view = memoryview(self._staging)
                while left:
                    part = view[: min(left, len(view))]
                    if not _recv_exact(self.sock, part):
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
        self.sock.close()


class _Desync(KVValidationError):
    """The stream broke its framing: its remaining bytes cannot be found, so the connection ends."""


def _error(code: grpc.StatusCode, message: str) -> kv_pb2.KVStreamReply:
    return kv_pb2.KVStreamReply(error=kv_pb2.KVStreamError(code=code.value[0], message=message))
