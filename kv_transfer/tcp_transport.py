"""KV blocks over a raw TCP data stream beside gRPC (gRPC stays the control plane), as
Mooncake's transfer engine does: ``TcpKVSender`` (prefill node) pushes to the decode node's
data port (receiver.py's ``TcpKVServer``, advertised as ``tcp://host:port`` in its index entry
and its reservations).

Why: grpcio moves a 3 MiB transfer at about a quarter of what the same socket moves, and pays
about 1 ms per call before a byte moves (docs/benchmarks.md, transfer). Here a transfer is
framed protobufs plus raw bytes on a connection that is kept open and reused (data_port.py
has the frames). Copies: the sender hands the pool's block views to one ``sendmsg`` per chunk
(the kernel gathers them: no staging buffer).

The receiver validates the header before it reads a chunk and checks every chunk's checksum
before it acknowledges (receiver.py); a refusal comes back as the status it names, a broken
or stalled stream as UNAVAILABLE / DEADLINE_EXCEEDED, and the next transport is tried.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

import grpc
import torch
from google.protobuf.message import DecodeError

from kv_transfer.checksum import new_checksum
from kv_transfer.data_port import MAX_IOV, SOCKET_BUFFER_BYTES, frame, read_frame, send_all, tune_socket
from kv_transfer.layout import PoolLayout
from kv_transfer.transport import PushResult, TransferError
from kv_transfer.validate import KVValidationError
from kv_transfer.wire import CHUNK_BYTES, build_header, payload_units
from protos.pdserve.v1 import kv_pb2

SCHEME = "tcp"
# Idle connections kept per endpoint (a node pushes from several threads at once).
MAX_IDLE_PER_ENDPOINT = 4
# A push on which no byte moved for this long fails with DEADLINE_EXCEEDED and falls back to
# the next transport, so a receiver that accepted the connection and stopped reading (a
# wedged process, an acceptor that never serves its backlog) holds the sender thread, the
# prefill node's blocks and the decode node's reservation for this long, not the push's whole
# deadline. A healthy receiver never pauses this long: it reads ~1 MiB chunks back to back.
PROGRESS_TIMEOUT_S = 5.0
# After its last byte: the receiver still checks and scatters what it had not read yet (at
# most the socket buffers' worth; shm: the whole payload) before it answers, so the wait for
# the reply gets this much per such byte beyond the progress timeout: 50 MB/s, about 80x
# below the slowest receiver measured (docs/benchmarks.md, transfer).
REPLY_SECONDS_PER_BYTE = 1 / 50e6


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` (IPv6 in brackets) -> (host, port). ValueError otherwise."""
    prefix = f"{SCHEME}://"
    if not endpoint.startswith(prefix):
        raise ValueError(f"not a {SCHEME} endpoint: {endpoint!r}")
    host, sep, port = endpoint[len(prefix):].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected {prefix}host:port, got {endpoint!r}")
    return host.strip("[]"), int(port)


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

    def wait_s(self) -> float | None:
        """How long a wait off the socket (a process group's, dist_transport.py) may take: the
        progress timeout, never past the deadline; TimeoutError when the deadline has passed."""
        wait = self._progress_s
        self.why = "timed out" if wait is None else f"no progress for {wait:.3g} s"
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                self.why = "past the push's deadline"
                raise TimeoutError(self.why)
            if wait is None or left < wait:
                self.why, wait = "past the push's deadline", left
        return wait

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
        dest_block_ids: Sequence[int], token: bytes, skip_leading_blocks: int = 0, layers: range | None = None,
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
            first_block_index=skip_leading_blocks, checksum_algorithm=checksum_algorithm, token=token,
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
            code = STATUS_CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN)
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
        return min(header.payload_bytes, 4 * SOCKET_BUFFER_BYTES)

    def _transfer(self, link: Link, header: kv_pb2.KVHeader, pool: torch.Tensor, send_ids: list[int],
                  clock: Clock) -> kv_pb2.KVStreamReply:
        sock = link.sock
        units = payload_units(pool, send_ids, range(header.layer_start, header.layer_start + header.layer_count))
        unit_bytes = units[0].nbytes
        per_chunk = max(1, min(MAX_IOV - 2, self._chunk_bytes // unit_bytes))
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
            send_all(sock, pending, clock.arm)
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
        body = read_frame(sock)
        if body is None:
            raise ConnectionError("receiver closed the connection without a reply")
        return kv_pb2.KVStreamReply.FromString(body)
    except (KVValidationError, DecodeError) as err:  # not a pdserve receiver, or out of step
        raise ConnectionError(f"garbled reply from the receiver: {err}") from None


# KVStreamError.code (a google.rpc.Code value) -> its status.
STATUS_CODES = {c.value[0]: c for c in grpc.StatusCode}
