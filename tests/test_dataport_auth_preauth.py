"""Strangers before any token check (issue 49, "pre-authentication exhaustion"): on the raw data
port (kv_transfer/receiver.py, data_conn.py) a peer that never passes a token check is dropped
at its deadline, however it spends it, may announce no frame larger than a header of the pool
(refused from its length, nothing allocated) and is one of a capped few; on gRPC PushBlocks
(node/admission.py) a stream that sends no header is cancelled and holds only its share of the
gate that Decode and Prefill share. Real sockets and a real gRPC server on loopback."""
from __future__ import annotations

import socket
import struct
import threading
import time
import tracemalloc
from concurrent import futures

import grpc
import pytest
import torch

from kv_transfer.data_conn import frame_limit
from kv_transfer.data_port import MAX_FRAME_BYTES, frame
from kv_transfer.grpc_transport import KV_GRPC_OPTIONS, PUSH_BLOCKS_PATH, KVReceiver, push_blocks
from kv_transfer.receiver import TcpKVServer
from kv_transfer.tcp_transport import TcpKVSender
from kv_transfer.validate import Reservation
from node.admission import FIRST_MESSAGE_GRACE_S, InflightGate, LongRpcInterceptor
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from tests.helpers import wait_for
from tests.test_kv_transfer import FP, SHAPE, TOKEN, make_pool

DEADLINE_S = 0.5


@pytest.fixture()
def port_server():
    pool = make_pool(torch.float32, seed=1)
    reservations = {"r": Reservation(0, (4,), (), TOKEN)}
    servers = []

    def make(**kw) -> TcpKVServer:
        server = TcpKVServer(pool, FP, on_received=lambda r: None, reservation_for=reservations.get, **kw)
        server.start()
        servers.append(server)
        return server

    yield make
    for s in servers:
        s.stop()


def _push(sender: TcpKVSender, server: TcpKVServer) -> int:
    src = make_pool(torch.float32, seed=2)
    return sender.push(f"tcp://127.0.0.1:{server.port}", src, request_id="r", fingerprint=FP, src_block_ids=[1],
                       block_hashes=[], num_tokens=2, dest_block_ids=[4], token=TOKEN, timeout=10).blocks_written


def _closed_after(sock: socket.socket, t0: float) -> float:
    """Seconds from ``t0`` until the receiver closed ``sock`` (its replies read and dropped)."""
    sock.settimeout(5)
    while sock.recv(1 << 16):
        pass
    return time.monotonic() - t0


def test_strangers_are_dropped_at_the_deadline_and_a_proven_sender_is_not(port_server) -> None:
    server = port_server(preauth_timeout_s=DEADLINE_S)
    sender = TcpKVSender()
    try:
        assert _push(sender, server) == 1  # proven: its kept connection may idle past the deadline
        t0 = time.monotonic()
        silent = socket.create_connection(("127.0.0.1", server.port))
        partial = socket.create_connection(("127.0.0.1", server.port))
        partial.sendall(b"\x00\x00")  # half a frame length, then nothing
        refused = socket.create_connection(("127.0.0.1", server.port))  # a whole refused transfer, then idle
        header = kv_pb2.KVHeader(request_id="no-such-request", token=b"x" * 16)
        refused.sendall(frame(kv_pb2.KVBlockMessage(header=header))
                        + frame(kv_pb2.KVBlockMessage(trailer=kv_pb2.KVTrailer())))
        for s in (silent, partial, refused):
            assert DEADLINE_S - 0.05 < _closed_after(s, t0) < DEADLINE_S + 1.0
            s.close()
        assert server.unproven.reaped == 3 and len(server.unproven) == 0
        time.sleep(0.1)
        assert _push(sender, server) == 1 and server.connections_accepted == 4  # the kept one, reused
    finally:
        sender.close()


def test_a_huge_first_frame_is_refused_by_its_length_without_allocating(port_server) -> None:
    server = port_server()
    limit = frame_limit(SHAPE[1], MAX_FRAME_BYTES)  # a header naming every block of the pool
    tracemalloc.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(struct.pack("!I", MAX_FRAME_BYTES - 1))  # 16 MiB announced, none sent
            data = b""
            while chunk := sock.recv(1 << 16):
                data += chunk
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    reply = kv_pb2.KVStreamReply.FromString(data[4:])
    assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert f"got {MAX_FRAME_BYTES - 1} bytes, expected <= {limit}" in reply.error.message
    assert peak < 1 << 20, f"{peak} bytes traced while refusing"


def test_unproven_connections_are_capped_and_proven_ones_are_not_counted(port_server) -> None:
    server = port_server(max_unproven=3)
    sender = TcpKVSender()
    strangers = []
    try:
        assert _push(sender, server) == 1
        strangers = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        assert wait_for(lambda: len(server.unproven) == 3, timeout=5)
        extra = socket.create_connection(("127.0.0.1", server.port))
        assert _closed_after(extra, time.monotonic()) < 1.0 and server.unproven.refused == 1
        extra.close()
        assert _push(sender, server) == 1  # the proven connection is not one of the few
        for s in strangers:
            s.close()
        assert wait_for(lambda: len(server.unproven) == 0, timeout=5)
        fresh = TcpKVSender()
        try:
            assert _push(fresh, server) == 1  # room again once the strangers left
        finally:
            fresh.close()
    finally:
        sender.close()
        for s in strangers:
            s.close()


def test_the_gate_lets_few_streams_wait_for_a_first_message_and_evicts_the_oldest() -> None:
    now = [0.0]
    gate = InflightGate(8, clock=lambda: now[0])
    cancelled = []
    assert gate.first_message_limit == 2
    for name in ("a", "b"):
        assert gate.enter(name, lambda n=name: cancelled.append(n)) is None
    # Real senders' streams opened together are within the grace: none is evicted for a newer one.
    now[0] = FIRST_MESSAGE_GRACE_S / 2
    assert gate.enter("x", lambda: cancelled.append("x")) is None and cancelled == []
    gate.first_message_seen("x")
    now[0] = FIRST_MESSAGE_GRACE_S
    assert gate.enter("c", lambda: cancelled.append("c")) is None
    assert cancelled == ["a"] and gate.awaiting_first_message == 2 and gate.num_evicted == 1
    gate.first_message_seen("b")
    assert gate.awaiting_first_message == 1 and gate.inflight == 4
    for _ in range(4):
        assert gate.enter() is None  # Decode and Prefill keep the rest of the slots
    assert gate.enter("d") == "busy" and gate.enter() == "busy"


class _Node(KVReceiver):
    """PushBlocks into a small pool, and ReserveBlocks as a long call standing in for Decode."""

    def ReserveBlocks(self, request, context):
        return kv_pb2.ReserveBlocksResponse()


def test_idle_push_blocks_streams_are_cancelled_and_do_not_starve_the_gate() -> None:
    pool = make_pool(torch.float32, seed=1)
    reservations = {"r": Reservation(0, (4,), (), TOKEN)}
    gate = InflightGate(4)  # one stream may wait for its first message
    reserve = "/pdserve.v1.KVTransfer/ReserveBlocks"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=KV_GRPC_OPTIONS,
                         interceptors=(LongRpcInterceptor(gate, (PUSH_BLOCKS_PATH, reserve), "n0",
                                                          first_message_timeout_s=DEADLINE_S),))
    kv_pb2_grpc.add_KVTransferServicer_to_server(_Node(pool, FP, lambda r: None, reservations.get), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    never = threading.Event()
    channel = grpc.insecure_channel(address, options=KV_GRPC_OPTIONS)

    def silent():
        never.wait(10)
        yield from ()

    try:
        push = channel.stream_unary(PUSH_BLOCKS_PATH, request_serializer=kv_pb2.KVBlockMessage.SerializeToString,
                                    response_deserializer=kv_pb2.PushBlocksResponse.FromString)
        t0 = time.monotonic()
        # Opened together, within the eviction grace: the first-message deadline ends them (the
        # eviction of older ones is the pure test's above).
        idle = [push.future(silent(), timeout=10) for _ in range(3)]
        assert wait_for(lambda: sum(f.done() for f in idle) >= 2, timeout=5)
        assert gate.awaiting_first_message <= 1
        stub = kv_pb2_grpc.KVTransferStub(channel)
        stub.ReserveBlocks(kv_pb2.ReserveBlocksRequest(), timeout=5)  # a long call still gets a slot
        src = make_pool(torch.float32, seed=2)
        resp = push_blocks(channel, src, request_id="r", fingerprint=FP, src_block_ids=[1], block_hashes=[],
                           num_tokens=2, dest_block_ids=[4], token=TOKEN, timeout=5)  # a real push gets through
        assert resp.blocks_written == 1 and torch.equal(pool[:, 4], src[:, 1])
        for f in idle:
            assert f.exception(timeout=5).code() == grpc.StatusCode.CANCELLED
        assert time.monotonic() - t0 < DEADLINE_S + 2.0  # the last one by its deadline
        assert wait_for(lambda: gate.inflight == 0 and gate.awaiting_first_message == 0, timeout=5)
    finally:
        never.set()
        channel.close()
        server.stop(grace=None)
