"""A KV peer that accepts the data connection and then stops reading, on 127.0.0.1: the tcp and
shm senders give up after their progress timeout (not the push's whole deadline), the push falls
back to gRPC and lands; the timing a push reports covers only the transport that carried it
(kv_transfer/transport.py FallbackKVSender, tcp_transport.py Clock)."""
from __future__ import annotations

import os
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from kv_transfer.buffers import BufferPool
from kv_transfer.grpc_transport import KV_GRPC_OPTIONS, GrpcKVSender, KVReceiver
from kv_transfer.shm_transport import ShmKVSender, buffer_prefix, shm_endpoint
from kv_transfer.tcp_transport import TcpKVSender
from kv_transfer.transport import FallbackKVSender, PushResult, TransferError
from kv_transfer.validate import Reservation, new_token
from protos.pdserve.v1 import kv_pb2_grpc

FP = "model-a"
TOKEN = new_token()
# Every push here has a deadline far beyond the progress timeout: a DEADLINE_EXCEEDED that
# names "no progress" came from the progress timeout, and a broken one would still end.
DEADLINE_S = 60.0
PROGRESS_S = 0.3


def pool_of(num_blocks: int, seed: int) -> torch.Tensor:
    # [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]: 64 KiB per block-layer
    return torch.randn((4, num_blocks, 2, 16, 8, 64), generator=torch.Generator().manual_seed(seed))


class StalledPeer:
    """Listens; accepts each connection and then reads nothing (a wedged receiver). A small
    receive buffer so a few MiB fill both socket buffers."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # inherited by accepted ones
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            c.close()


@pytest.fixture()
def peer():
    p = StalledPeer()
    yield p
    p.close()


def blocks(n: int, dest: list[int] | None = None) -> dict:
    """n blocks of a prompt, the first n - 1 full (hashes 1, 2, ...), into ``dest`` (default 0..n)."""
    return dict(request_id="r", fingerprint=FP, src_block_ids=list(range(n)), block_hashes=list(range(1, n)),
                num_tokens=16 * n - 1, dest_block_ids=list(range(n)) if dest is None else dest, token=TOKEN,
                timeout=DEADLINE_S)


@pytest.mark.parametrize("num_blocks", [1, 64], ids=["waits-for-reply", "blocks-in-send"])
def test_tcp_sender_gives_up_on_a_peer_that_stopped_reading(peer: StalledPeer, num_blocks: int) -> None:
    """1 block fits the socket buffers (the sender waits for the reply); 64 blocks (16 MiB) do
    not (the sender's sendmsg stops moving)."""
    sender = TcpKVSender(progress_timeout_s=PROGRESS_S)
    try:
        with pytest.raises(TransferError) as err:
            sender.push(f"tcp://127.0.0.1:{peer.port}", pool_of(64, 0), **blocks(num_blocks))
    finally:
        sender.close()
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no progress" in err.value.details, err.value.details
    assert len(peer.conns) == 1


def test_shm_sender_gives_up_on_a_peer_that_stopped_reading(peer: StalledPeer) -> None:
    """The attach frame is never answered."""
    sender = ShmKVSender(progress_timeout_s=PROGRESS_S)
    try:
        with pytest.raises(TransferError) as err:
            sender.push(shm_endpoint(f"127.0.0.1:{peer.port}"), pool_of(4, 0), **blocks(2))
    finally:
        sender.close()
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "no progress" in err.value.details
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(buffer_prefix())]  # buffer gone with the link


def test_the_push_deadline_still_bounds_a_push() -> None:
    """Without a progress timeout the push's own timeout ends it, named as such."""
    p = StalledPeer()
    sender = TcpKVSender(progress_timeout_s=None)
    try:
        with pytest.raises(TransferError) as err:
            sender.push(f"tcp://127.0.0.1:{p.port}", pool_of(64, 0), **{**blocks(1), "timeout": PROGRESS_S})
    finally:
        sender.close()
        p.close()
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline" in err.value.details


class GrpcReceiver:
    """The decode node's gRPC PushBlocks on a real server, into its own pool."""

    def __init__(self) -> None:
        self.pool = pool_of(64, 1)
        self.reservations: dict[str, Reservation] = {}
        self.received = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=KV_GRPC_OPTIONS)
        kv_pb2_grpc.add_KVTransferServicer_to_server(
            KVReceiver(self.pool, FP, self.received.append, self.reservations.get, BufferPool()), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=None)


class Slow:
    """Wraps a sender: each push first sleeps, so the attempt's time is known to be at least that."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.scheme = getattr(inner, "scheme", "grpc")

    def push(self, endpoint, pool, **kw) -> PushResult:
        time.sleep(self.delay_s)
        return self.inner.push(endpoint, pool, **kw)

    def advertised(self) -> str:
        return self.inner.advertised()

    def close(self) -> None:
        self.inner.close()


def test_a_stalled_fast_transport_falls_back_and_only_the_landed_attempt_is_timed(peer: StalledPeer) -> None:
    node = GrpcReceiver()
    src = pool_of(64, 2)
    node.reservations["r"] = Reservation(0, tuple(range(8)), tuple(range(1, 8)), TOKEN)
    # gRPC slowed by a known delay, so the timing cannot pass for the whole wall time by luck.
    sender = FallbackKVSender([TcpKVSender(progress_timeout_s=PROGRESS_S)], Slow(GrpcKVSender(), 0.05))
    try:
        t0 = time.monotonic()
        got = sender.push(node.address, src, endpoints=[f"tcp://127.0.0.1:{peer.port}"], **blocks(8))
        wall = time.monotonic() - t0
    finally:
        sender.close()
        node.close()
    assert got.transport == "grpc" and got.fallbacks == 1 and sender.num_fallbacks == 1
    assert got.blocks_written == 8 and torch.equal(node.pool[:, :8], src[:, :8])  # never lost
    # The stalled attempt took at least the progress timeout; the reported time leaves it out.
    assert wall >= PROGRESS_S and 0.05 <= got.seconds <= wall - PROGRESS_S


def test_a_transport_that_does_not_apply_is_skipped_not_counted() -> None:
    node = GrpcReceiver()
    node.reservations["r"] = Reservation(0, (3,), (), TOKEN)
    sender = FallbackKVSender([ShmKVSender()], GrpcKVSender())
    try:
        got = sender.push(node.address, pool_of(4, 3), endpoints=["shm://another-boot/127.0.0.1:1"],
                          **blocks(1, dest=[3]))
    finally:
        sender.close()
        node.close()
    assert got.transport == "grpc" and got.fallbacks == 0 and sender.num_fallbacks == 0 and got.seconds > 0
    assert sender.advertised()[0].startswith("shm://") and sender.advertised()[0].endswith("/")
