"""The decode node's data port: ``TcpKVServer`` receives the transfers of both tcp_transport.py
and shm_transport.py senders into one KV pool, on a listening TCP socket (advertised as
``shm://<host key>/host:port`` and ``tcp://host:port``). Framing: data_port.py.

Copies: on a CPU pool a tcp chunk's destination blocks go to ``recvmsg_into`` (the kernel
scatters into them: no staging buffer; consecutive blocks merge into one view) and are
checksummed there. A device pool reads each chunk into a small reused buffer, checks it, then
copies it to the device; an shm chunk is checked in the sender's buffer, then scattered.

Who may write: a transfer's header must carry its reservation's token, and a shared-memory
attach must name a live reservation and its token before the receiver opens any file
(validate.py's ``check_token``); a peer refused for its token loses the connection. Until a
token check passed on it, a connection is held to data_conn.py's bounds (few such connections,
a deadline from accept, frames no larger than a header of this pool).

Integrity: the header (request, token, reservation, block ids, shape, dtype, fingerprint) is
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
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import grpc
import numpy as np
import torch

from kv_transfer.checksum import new_checksum
from kv_transfer.data_conn import (
    MAX_CHUNK_BYTES,
    MAX_UNPROVEN_CONNECTIONS,
    PREAUTH_TIMEOUT_S,
    Connection,
    Desync,
    UnprovenConnections,
    error_reply,
    frame_limit,
    parse,
)
from kv_transfer.data_port import (
    MAX_FRAME_BYTES,
    MAX_IOV,
    advance,
    frame,
    read_frame,
    send_all,
    tune_socket,
)
from kv_transfer.dist_group import DistRendezvous, dist_attach
from kv_transfer.layout import PoolLayout
from kv_transfer.validate import (
    HeaderGate,
    KVDataLossError,
    KVPermissionError,
    KVUnauthenticatedError,
    KVValidationError,
    ReceivedBlocks,
    Reservation,
    check_payload_bytes,
    status_code,
)
from kv_transfer.wire import unit_rows
from protos.pdserve.v1 import kv_pb2

log = logging.getLogger(__name__)

# A transfer with no progress for this long fails (its reservation can be freed).
STALL_TIMEOUT_S = 30.0
# Connections served at once (a thread each); more are closed at once.
MAX_CONNECTIONS = 256


class TcpKVServer:
    """Receives transfers into one KV pool on a listening TCP socket; one thread per
    connection, connections serve transfer after transfer.

    The hooks are the decode node's, as for KVReceiver: ``reservation_for(rid)`` what a
    transfer is checked against; ``begin_push(rid)`` (False: refuse, no reservation) and
    ``end_push(rid)`` bracket every transfer that got past its header, so the reservation's
    blocks are not released while this server may write into them; ``on_received`` runs after
    a complete transfer is in the pool, before the sender is answered; ``on_outcome(ok,
    payload_bytes, seconds)`` once per transfer, refused ones included (metrics).
    ``preauth_timeout_s`` and ``max_unproven``: data_conn.py's bounds on connections that have
    not passed a token check yet.
    """

    def __init__(
        self, pool: torch.Tensor, fingerprint: str, *,
        on_received: Callable[[ReceivedBlocks], None],
        reservation_for: Callable[[str], Reservation | None],
        begin_push: Callable[[str], bool] = lambda rid: True,
        end_push: Callable[[str], None] = lambda rid: None,
        on_outcome: Callable[[bool, int, float], None] = lambda ok, nbytes, seconds: None,
        host: str = "127.0.0.1", port: int = 0, stall_timeout_s: float = STALL_TIMEOUT_S, dist: bool = False,
        preauth_timeout_s: float = PREAUTH_TIMEOUT_S, max_unproven: int = MAX_UNPROVEN_CONNECTIONS,
    ) -> None:
        self._stall_timeout_s = stall_timeout_s
        self.unproven = UnprovenConnections(max_unproven, preauth_timeout_s)
        # Process groups for dist senders (dist_group.py); None: a dist attach is refused.
        self.dist = DistRendezvous(host) if dist else None
        self._layout = PoolLayout.of(pool)
        self._frame_limit = frame_limit(self._layout.num_blocks, MAX_FRAME_BYTES)
        self._gate = HeaderGate(self._layout, fingerprint, reservation_for)
        # [num_layers * num_blocks, block_bytes]: one block-layer ("unit") per row, unit (l, b)
        # at row l * num_blocks + b. numpy's indexed assignment for a CPU pool (torch's
        # index_put_ on uint8 rows is ~200x slower there), index_copy_ on a device.
        rows = pool.view(-1).view(torch.uint8).view(-1, self._layout.block_bytes)
        self._rows = rows.numpy() if pool.device.type == "cpu" else rows
        self._on_received = on_received
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
        self.unproven.stop()
        if self.dist is not None:
            self.dist.close()

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
                if not self.unproven.admit(conn):  # strangers hold at most a few
                    log.warning("KV data port %s: %d connections without a valid token open, refusing another",
                                self.port, self.unproven.max_unproven)
                    conn.close()
                    continue
                self._conns.add(conn)
                self.connections_accepted += 1
            tune_socket(conn)
            threading.Thread(target=self._serve, args=(conn,), name=f"kv-tcp-conn-{self.port}", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = Connection(sock, self._frame_limit, lambda: self.unproven.proven(sock))
        try:
            while True:
                # A kept connection may idle between transfers (an unproven one: until the
                # reaper shuts it down at its deadline).
                sock.settimeout(None)
                try:
                    body = read_frame(sock, self._frame_limit)
                except KVValidationError as err:  # refused from its length: nothing was allocated
                    send_all(sock, [frame(error_reply(grpc.StatusCode.INVALID_ARGUMENT, str(err)))])
                    return
                if body is None:
                    return
                # A sender that stalls mid-transfer must not pin its reservation (no release
                # while a push is in flight): no progress for stall_timeout_s fails the transfer.
                sock.settimeout(self._stall_timeout_s)
                try:
                    msg = parse(body)
                except Desync as err:
                    reply, keep = error_reply(grpc.StatusCode.INVALID_ARGUMENT, str(err)), False
                else:
                    kind = msg.WhichOneof("kind")
                    if kind == "attach":
                        reply, keep = self._attach(conn, msg.attach)
                    elif kind == "dist_attach":
                        reply, keep = dist_attach(self.dist, self._gate, conn, msg.dist_attach, MAX_CHUNK_BYTES)
                    else:
                        reply, keep = self._one(conn, msg)
                if reply is not None:  # a dist attach answers before it joins the group
                    send_all(sock, [frame(reply)])
                if not keep:
                    return
        except (OSError, KVValidationError) as err:  # the sender went away or spoke garbage
            log.debug("KV data connection closed: %r", err)
        finally:
            with self._lock:
                self._conns.discard(sock)
            self.unproven.proven(sock)  # gone: no longer counted
            conn.close()

    def _attach(self, conn: Connection, attach: kv_pb2.KVAttach) -> tuple[kv_pb2.KVStreamReply, bool]:
        """Map the sender's buffer, only for a peer that names a live reservation and its
        token: no file is opened for anyone else. -> (reply, keep the connection)."""
        try:
            self._gate.authenticate(attach.request_id, attach.token)
        except KVValidationError as err:
            return error_reply(status_code(err), f"attach: {err}"), False
        conn.prove()
        return conn.attach(attach), True

    def _one(self, conn: Connection, msg: kv_pb2.KVBlockMessage) -> tuple[kv_pb2.KVStreamReply, bool]:
        """One transfer whose first message is ``msg`` -> (reply, keep the connection). A
        refused transfer's remaining frames are read and dropped, so the sender gets its reply
        and the connection stays in step."""
        began, ok, t0 = None, False, time.monotonic()
        nbytes = 0
        try:
            header = self._gate.header(msg)
            if not self._begin_push(header.request_id):  # before the lookup: see HeaderGate
                raise HeaderGate.not_reserved(header.request_id)
            began = header.request_id
            self._gate.admit(header)
            conn.prove()
            if conn.group is not None:  # its first chunk's receive, before its bytes come
                conn.group.expect(header.payload_bytes, self._layout.block_bytes)
            self._receive(conn, header)
            received = ReceivedBlocks.of(header)
            try:
                self._on_received(received)
            except Exception as err:  # the sender must learn the blocks were not taken
                return error_reply(grpc.StatusCode.INTERNAL, f"on_received failed: {err!r}"), True
            ok, nbytes = True, header.payload_bytes
            written = kv_pb2.PushBlocksResponse(blocks_written=len(received.block_ids), bytes_written=nbytes)
            return kv_pb2.KVStreamReply(ok=written), True
        except KVValidationError as err:
            # Drained either way, so the sender reads its refusal rather than a reset; a peer
            # without the reservation's token is not served again on this connection.
            keep = conn.drain() if not isinstance(err, Desync) else False
            if isinstance(err, (KVUnauthenticatedError, KVPermissionError)):
                keep = False
            return error_reply(status_code(err), str(err)), keep
        finally:
            if began is not None:
                self._end_push(began)
            self._on_outcome(ok, nbytes, time.monotonic() - t0)

    def _receive(self, conn: Connection, header: kv_pb2.KVHeader) -> None:
        """Chunks and trailer of a validated header; each chunk checked, then scattered."""
        unit = self._layout.block_bytes
        # The pool row of every unit, once per transfer (bounded: the header was validated
        # against the reservation); a chunk's rows are a slice of it.
        all_rows = unit_rows(header.layer_start, header.layer_count, header.dest_block_ids, self._layout.num_blocks)
        received, seq = 0, 0
        while True:
            body = read_frame(conn.sock, conn.frame_limit)
            if body is None:
                raise Desync(f"stream ended without trailer after {received} of {header.payload_bytes} payload bytes")
            msg = parse(body)
            kind = msg.WhichOneof("kind")
            if kind == "trailer":
                check_payload_bytes(header, received)
                return
            if kind != "chunk":
                raise Desync(f"message after header: got {kind}, expected chunk or trailer")
            chunk, n = msg.chunk, msg.chunk.raw_bytes
            if chunk.seq != seq:
                raise Desync(f"chunk seq: got {chunk.seq}, expected {seq}")
            if n == 0 or n % unit or n > MAX_CHUNK_BYTES or received + n > header.payload_bytes:
                raise Desync(f"chunk {seq} raw_bytes: got {n}, expected a multiple of {unit} bytes, "
                              f"<= {MAX_CHUNK_BYTES}, within payload_bytes={header.payload_bytes} "
                              f"({received} received)")
            # Units [first, first + k) of the payload (wire.py's order).
            first, k = received // unit, n // unit
            rows = all_rows[first : first + k]
            checksum = new_checksum(header.checksum_algorithm)
            if isinstance(self._rows, np.ndarray) and not chunk.HasField("shm_offset") and not chunk.over_group:
                # Straight from the socket into the reserved blocks (one readv per call) and
                # checked there: the staging buffer's extra pass was about a quarter of a
                # chunk's time. A chunk that fails its checksum has written only into blocks
                # reserved for this transfer, as a transfer that fails part-way always has.
                views = row_views(self._rows, rows)
                _recv_into_views(conn.sock, views)
                for v in views:
                    checksum.update(v)
                _check_chunk(seq, checksum.value(), chunk.checksum)
            else:
                # [n] uint8, from the shared buffer or staged; over a group, the next chunk's
                # receive is posted at once (chunks are all as large as the first but the last)
                data = conn.chunk_data(chunk, next_n=min(n, header.payload_bytes - received - n))
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


def row_views(rows: np.ndarray, idx: np.ndarray) -> list[memoryview]:
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
        n = sock.recvmsg_into([pending[i] for i in range(min(len(pending), MAX_IOV))])[0]
        if n == 0:
            raise Desync("stream ended inside a chunk")
        advance(pending, n)
