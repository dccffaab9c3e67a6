"""KV blocks over a two-rank torch.distributed process group: ``DistKVSender`` (scheme ``dist``).

The receiver is the decode node's data port (receiver.TcpKVServer), which advertises
``dist://host:port`` (its data port) when the node runs with ``--kv-dist``. The control stays
on the kept data connection, exactly as for tcp (the same header validation, per-chunk
checksums, trailer and reply); only the chunks' bytes move over the connection's process
group (dist_group.py, where the rendezvous and its key are)::

    sender:   gather chunk k's block-layers from the pool into a staging buffer (one copy),
              checksum it, send frame(chunk: seq, raw_bytes, checksum, over_group), then
              the buffer over the group (gloo send; two buffers, so chunk k+1 is gathered
              while chunk k is on its way)
    receiver: receive it into its staging buffer, check the checksum, scatter it into the
              reserved blocks (receiver.py)

A group is made per kept data connection on its first transfer (a sender pushing from one
thread keeps one connection, so one group, per receiver), reused by every later transfer on
it and aborted with it: when either end closes it or a transfer on it fails. Every wait on
the group is bounded by the push's clock (the progress timeout, never past its deadline) and
the group's own timeout; a receiver that stops receiving fails the push with
DEADLINE_EXCEEDED, one that died with UNAVAILABLE, and FallbackKVSender tries the next
transport. The set-up time of each group is measured (``groups_made``, ``setup_s_total``).
"""
from __future__ import annotations

import socket
import threading
import time

import grpc
import numpy as np
import torch

from kv_transfer.checksum import new_checksum
from kv_transfer.data_port import frame, send_all
from kv_transfer.dist_group import PairGroup, sender_group
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
from kv_transfer.transport import TransferError
from kv_transfer.wire import unit_rows
from protos.pdserve.v1 import kv_pb2

SCHEME = "dist"
# Bytes per group send. 1, 2, 4 and 8 MiB measured within noise of each other on loopback
# (ratio to the socket 0.53-0.60, `pdserve bench transfer`, 2026-12-02); 2 MiB keeps the two
# staging buffers small. The receiver takes up to 16 MiB (receiver.MAX_CHUNK_BYTES).
DIST_CHUNK_BYTES = 2 << 20


def dist_endpoint(host_port: str) -> str:
    """What a data server on ``host:port`` with process groups advertises."""
    return f"{SCHEME}://{host_port}"


def parse_dist_endpoint(endpoint: str) -> tuple[str, int]:
    """``dist://host:port`` -> (host, port). ValueError otherwise."""
    prefix = f"{SCHEME}://"
    if not endpoint.startswith(prefix):
        raise ValueError(f"not a {SCHEME} endpoint: {endpoint!r}")
    return parse_endpoint(f"{TCP_SCHEME}://{endpoint[len(prefix):]}")


class _DistLink(Link):
    """A kept data connection and its process group, with two staging buffers."""

    def __init__(self, sock: socket.socket, group: PairGroup) -> None:
        super().__init__(sock)
        self.group = group
        self._staging: list[torch.Tensor | None] = [None, None]

    def staging(self, slot: int, n: int) -> torch.Tensor:
        """Staging buffer ``slot`` (0 or 1) as [n] uint8, grown when too small."""
        buf = self._staging[slot]
        if buf is None or buf.numel() < n:
            buf = self._staging[slot] = torch.empty(n, dtype=torch.uint8)
        return buf[:n]

    def close(self) -> None:
        self.group.close()
        super().close()


class DistKVSender(TcpKVSender):
    """``push`` over ``dist://`` endpoints. Same arguments and errors as TcpKVSender; a
    receiver that offers no process groups answers UNAVAILABLE (the next transport is tried)."""

    scheme = SCHEME

    def __init__(self, connect_timeout_s: float = 5.0, chunk_bytes: int = DIST_CHUNK_BYTES,
                 progress_timeout_s: float | None = PROGRESS_TIMEOUT_S) -> None:
        super().__init__(connect_timeout_s, chunk_bytes, progress_timeout_s)
        self._stats = threading.Lock()
        self.groups_made = 0
        self.groups_dropped = 0  # closed because a transfer on them failed
        self.setup_s_total = 0.0  # set-up of every group made (the dist attach and the join)

    def advertised(self) -> str:
        return f"{SCHEME}://"

    def _address(self, endpoint: str) -> tuple[str, int]:
        return parse_dist_endpoint(endpoint)

    def _open(self, sock: socket.socket, header: kv_pb2.KVHeader, clock: Clock) -> _DistLink:
        t0 = time.monotonic()
        try:
            attach = kv_pb2.KVDistAttach(request_id=header.request_id, token=header.token,
                                         chunk_bytes=self._chunk_bytes)
            send_all(sock, [frame(kv_pb2.KVBlockMessage(dist_attach=attach))], clock.arm)
            clock.arm(sock)
            reply = read_reply(sock)
            kind = reply.WhichOneof("kind")
            if kind == "error":
                code = STATUS_CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN)
                raise TransferError(code, reply.error.message)
            if kind != "dist":
                raise ConnectionError(f"dist attach answered with {kind}, expected dist")
            try:
                group = sender_group(sock.getpeername()[0], reply.dist, sock.getsockname()[0])
            except RuntimeError as err:  # the receiver's store or the group did not answer in time
                raise ConnectionError(f"process group did not form: {err}") from None
        except BaseException:
            sock.close()
            raise
        with self._stats:
            self.groups_made += 1
            self.setup_s_total += time.monotonic() - t0
        return _DistLink(sock, group)

    def _unread_bytes(self, header: kv_pb2.KVHeader) -> int:
        # Every send completed before the trailer leaves (the receiver took the bytes), so at
        # most the last two chunks are still to be checked and scattered.
        return min(header.payload_bytes, 2 * self._chunk_bytes)

    def _transfer(self, link: _DistLink, header: kv_pb2.KVHeader, pool: torch.Tensor, send_ids: list[int],
                  clock: Clock) -> kv_pb2.KVStreamReply:
        try:
            return self._send(link, header, pool, send_ids, clock)
        except BaseException:  # push closes the link, and its group with it
            with self._stats:
                self.groups_dropped += 1
            raise

    def _send(self, link: _DistLink, header: kv_pb2.KVHeader, pool: torch.Tensor, send_ids: list[int],
              clock: Clock) -> kv_pb2.KVStreamReply:
        sock, group = link.sock, link.group
        layout = PoolLayout.of(pool)
        unit = layout.block_bytes
        # [num_layers * num_blocks, block_bytes]: unit (l, b) at row l * num_blocks + b
        rows = pool.view(-1).view(torch.uint8).view(-1, unit)
        rows_np = rows.numpy() if pool.device.type == "cpu" else None
        all_idx = unit_rows(header.layer_start, header.layer_count, send_ids, layout.num_blocks)  # [n_units]
        per_chunk = max(1, self._chunk_bytes // unit)
        send_all(sock, [frame(kv_pb2.KVBlockMessage(header=header))], clock.arm)
        in_flight = [None, None]  # the send of each staging buffer not yet waited for
        for seq, first in enumerate(range(0, len(all_idx), per_chunk)):
            slot = seq % 2
            if in_flight[slot] is not None:  # its buffer is about to be overwritten
                group.wait(in_flight[slot], clock.wait_s())
                in_flight[slot] = None
            idx = all_idx[first : first + per_chunk]
            buf = link.staging(slot, len(idx) * unit)  # [n] uint8
            if rows_np is not None:
                # the one gather, into the staging buffer: numpy's ("clip": mode "raise" buffers
                # the output), about 20x torch.index_select's speed on uint8 rows here
                np.take(rows_np, idx, axis=0, out=buf.numpy().reshape(len(idx), unit), mode="clip")
            else:
                buf.view(len(idx), unit).copy_(rows.index_select(0, torch.from_numpy(idx).to(pool.device)))
            checksum = new_checksum(header.checksum_algorithm)
            checksum.update(buf.numpy())
            chunk = kv_pb2.KVChunk(seq=seq, raw_bytes=buf.numel(), checksum=checksum.value(), over_group=True)
            send_all(sock, [frame(kv_pb2.KVBlockMessage(chunk=chunk))], clock.arm)
            in_flight[slot] = group.send(buf)
        for work in in_flight:
            if work is not None:
                group.wait(work, clock.wait_s())
        send_all(sock, [frame(kv_pb2.KVBlockMessage(trailer=kv_pb2.KVTrailer()))], clock.arm)
        return self._reply(sock, header, clock)
