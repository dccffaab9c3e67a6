"""The raw TCP data stream (kv_transfer/tcp_transport.py, receiver.py) on 127.0.0.1 and the fallback between
transports (kv_transfer/transport.py): bit-exact round trips over kept connections, refusals
that leave the pool and the connection intact, chunk checksums that fail a transfer having
written only into its reserved blocks, and a failed fast transfer falling back to gRPC."""
from __future__ import annotations

import os
import socket
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

from kv_transfer.buffers import BufferPool
from kv_transfer.checksum import new_checksum
from kv_transfer.data_port import frame
from kv_transfer.grpc_transport import KV_GRPC_OPTIONS, GrpcKVSender, KVReceiver
from kv_transfer.layout import PoolLayout
from kv_transfer.receiver import TcpKVServer, row_views
from kv_transfer.shm_transport import ShmKVSender, buffer_prefix, parse_shm_endpoint, shm_endpoint
from kv_transfer.tcp_transport import TcpKVSender, parse_endpoint
from kv_transfer.transport import FallbackKVSender, PushResult, TransferError
from kv_transfer.validate import Reservation, new_token
from kv_transfer.wire import build_header, payload_units
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from tests.helpers import wait_for
from tests.test_kv_transfer import BLOCK_SIZE, FP, SHAPE, TOKEN, make_pool


class Receiver:
    """A decode-node stand-in: one pool, reservations, the TCP data server and a gRPC server."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.pool = make_pool(dtype, seed=1)
        self.before = self.pool.clone()
        self.reservations: dict[str, Reservation] = {}
        self.received = []
        self.outcomes: list[bool] = []
        self.in_flight: list[str] = []
        self.data = TcpKVServer(self.pool, FP, on_received=self.received.append,
                                reservation_for=self.reservations.get, begin_push=self._begin,
                                end_push=self.in_flight.remove,
                                on_outcome=lambda ok, nbytes, s: self.outcomes.append(ok))
        self.endpoint = f"tcp://127.0.0.1:{self.data.start()}"
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=KV_GRPC_OPTIONS)
        kv_pb2_grpc.add_KVTransferServicer_to_server(
            KVReceiver(self.pool, FP, self.received.append, self.reservations.get, BufferPool()), self.grpc)
        self.address = f"127.0.0.1:{self.grpc.add_insecure_port('127.0.0.1:0')}"
        self.grpc.start()

    def _begin(self, rid: str) -> bool:
        if rid not in self.reservations:
            return False
        self.in_flight.append(rid)
        return True

    def close(self) -> None:
        self.data.stop()
        self.grpc.stop(grace=None)

    def unchanged(self) -> bool:
        return torch.equal(self.pool, self.before) and not self.received


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def node(request):
    n = Receiver(request.param)
    yield n
    n.close()


@pytest.fixture()
def sender():
    s = TcpKVSender(chunk_bytes=700)  # several chunks per transfer on the tiny pool
    yield s
    s.close()


def push(sender, node: Receiver, src: torch.Tensor, rid: str, src_ids, dest_ids, **kw) -> PushResult:
    return sender.push(node.endpoint, src, request_id=rid, fingerprint=FP, src_block_ids=src_ids,
                       block_hashes=kw.pop("hashes", []), num_tokens=kw.pop("num_tokens", 2),
                       dest_block_ids=dest_ids, token=kw.pop("token", TOKEN), timeout=10, **kw)


def test_parse_endpoint() -> None:
    assert parse_endpoint("tcp://10.0.0.7:4123") == ("10.0.0.7", 4123)
    assert parse_endpoint("tcp://[::1]:80") == ("::1", 80)
    for bad in ("10.0.0.7:4123", "tcp://host", "shm://x:1"):
        with pytest.raises(ValueError):
            parse_endpoint(bad)


def test_round_trip_bit_exact_layer_range_skip_and_reused_connection(node: Receiver, sender) -> None:
    src = make_pool(node.pool.dtype, seed=2)
    num_tokens = 3 * BLOCK_SIZE - 1  # last block partial: no hash for it
    node.reservations["r1"] = Reservation(1, (5, 0, 11), (0xBBBB, 0xCCCC), TOKEN)
    got = push(sender, node, src, "r1", [4, 7, 2, 9], [5, 0, 11], hashes=[0xAAAA, 0xBBBB, 0xCCCC],
               num_tokens=num_tokens + BLOCK_SIZE, skip_leading_blocks=1, layers=range(1, 3))
    unit = PoolLayout.of(src).block_bytes
    assert got == PushResult(3, 2 * 3 * unit, "grpc")  # the sender's own result; FallbackKVSender names it
    expected = node.before.clone()
    expected[1:3, [5, 0, 11]] = src[1:3, [7, 2, 9]]
    assert torch.equal(node.pool, expected)  # written blocks bit-exact, nothing else touched
    assert node.received[0].layers == range(1, 3) and node.received[0].first_block_index == 1

    node.reservations["r2"] = Reservation(0, (3,), (), TOKEN)
    push(sender, node, src, "r2", [6], [3])
    assert torch.equal(node.pool[:, 3], src[:, 6])
    assert node.data.connections_accepted == 1  # the second transfer reused the connection
    assert node.outcomes == [True, True] and node.in_flight == []


def test_refusal_leaves_pool_and_connection_intact(node: Receiver, sender) -> None:
    src = make_pool(node.pool.dtype, seed=3)
    two = dict(num_tokens=2 * BLOCK_SIZE - 1, hashes=[7])  # two blocks, the first one full
    with pytest.raises(TransferError) as err:  # no reservation
        push(sender, node, src, "nobody", [1, 2], [5, 0], **two)
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "reservation" in err.value.details
    node.reservations["r"] = Reservation(0, (5, 0), (7,), TOKEN)
    with pytest.raises(TransferError) as err:  # not the reserved ids
        push(sender, node, src, "r", [1, 2], [0, 5], **two)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "dest_block_ids (reserved)" in err.value.details
    with pytest.raises(TransferError) as err:
        sender.push(node.endpoint, src, request_id="r", fingerprint="model-b", src_block_ids=[1, 2],
                    block_hashes=[7], num_tokens=7, dest_block_ids=[5, 0], token=TOKEN, timeout=10)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "model_fingerprint" in err.value.details
    assert node.unchanged()
    push(sender, node, src, "r", [1, 2], [5, 0], **two)
    assert node.data.connections_accepted == 1 and node.outcomes == [False, False, False, True]


def _stream(src: torch.Tensor, dest_ids, src_ids, *, bad_seq: int | None = None, units_per_chunk: int = 2) -> bytes:
    """A hand-made transfer of all layers: header, chunks (chunk ``bad_seq`` with a wrong checksum), trailer."""
    header = build_header(request_id="r", fingerprint=FP, layout=PoolLayout.of(src), dest_block_ids=list(dest_ids),
                          block_hashes=[], num_tokens=2, layers=range(SHAPE[0]), token=TOKEN,
                          checksum_algorithm=kv_pb2.CHECKSUM_ALGORITHM_XXH3_64)
    units = payload_units(src, list(src_ids), range(SHAPE[0]))
    out = [frame(kv_pb2.KVBlockMessage(header=header))]
    for seq, start in enumerate(range(0, len(units), units_per_chunk)):
        data = b"".join(u.tobytes() for u in units[start : start + units_per_chunk])
        c = new_checksum(header.checksum_algorithm)
        c.update(data)
        chunk = kv_pb2.KVChunk(seq=seq, raw_bytes=len(data), checksum=c.value() ^ (seq == bad_seq))
        out += [frame(kv_pb2.KVBlockMessage(chunk=chunk)), data]
    out.append(frame(kv_pb2.KVBlockMessage(trailer=kv_pb2.KVTrailer())))
    return b"".join(out)


def _reply(sock: socket.socket) -> kv_pb2.KVStreamReply:
    data = b""
    while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
        more = sock.recv(1 << 16)
        assert more, "connection closed before the reply"
        data += more
    return kv_pb2.KVStreamReply.FromString(data[4:])


def test_chunk_checksum_fails_the_transfer_and_touches_only_reserved_blocks(node: Receiver) -> None:
    src = make_pool(node.pool.dtype, seed=4)
    node.reservations["r"] = Reservation(0, (6,), (), TOKEN)  # 1 block x 4 layers = 4 units, 2 per chunk
    others = [b for b in range(node.pool.shape[1]) if b != 6]
    with socket.create_connection(("127.0.0.1", node.data.port), timeout=10) as sock:
        sock.sendall(_stream(src, [6], [3], bad_seq=0))
        reply = _reply(sock)
        assert reply.error.code == grpc.StatusCode.DATA_LOSS.value[0] and "checksum" in reply.error.message
        # The chunk is received straight into its reserved block and checked there: every
        # other block is untouched, and nothing was taken.
        assert torch.equal(node.pool[:, others], node.before[:, others]) and not node.received

        sock.sendall(_stream(src, [6], [3], bad_seq=1))  # the connection stayed in step
        assert _reply(sock).WhichOneof("kind") == "error"
        # Chunks land in the reserved block as they are read; chunk 1 failed its check, so no
        # transfer was accepted and the reservation stays incomplete until a whole rewrite or
        # its release. Nothing outside it was written.
        assert torch.equal(node.pool[:, others], node.before[:, others])
        assert not node.received

        sock.sendall(_stream(src, [6], [3]))
        assert _reply(sock).ok.blocks_written == 1
    assert torch.equal(node.pool[:, 6], src[:, 3])
    assert node.outcomes == [False, False, True] and node.in_flight == []


def test_garbage_closes_only_its_connection(node: Receiver, sender) -> None:
    with socket.create_connection(("127.0.0.1", node.data.port), timeout=10) as sock:
        sock.sendall(b"\x00\x00\x00\x05hello")
        data = b""
        while more := sock.recv(1 << 16):  # an error reply, then the close
            data += more
    assert kv_pb2.KVStreamReply.FromString(data[4:]).error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    node.reservations["r"] = Reservation(0, (2,), (), TOKEN)
    push(sender, node, make_pool(node.pool.dtype, seed=5), "r", [1], [2])
    assert node.received


def test_shm_endpoint_that_cannot_map_is_not_tried_again() -> None:
    """A receiver on this kernel but with another /dev/shm (pods on one machine) refuses the attach."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def refuse_attach() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.recv(1 << 16)  # the attach frame
            refusal = kv_pb2.KVStreamError(code=grpc.StatusCode.UNAVAILABLE.value[0], message="cannot open")
            conn.sendall(frame(kv_pb2.KVStreamReply(error=refusal)))

    threading.Thread(target=refuse_attach, daemon=True).start()
    endpoint = shm_endpoint(f"127.0.0.1:{listener.getsockname()[1]}")
    sender = ShmKVSender()
    blocks = dict(request_id="r", fingerprint=FP, src_block_ids=[1], block_hashes=[], num_tokens=2,
                  dest_block_ids=[4], token=TOKEN, timeout=10)
    try:
        for _ in range(2):
            with pytest.raises(TransferError) as err:
                sender.push(endpoint, make_pool(torch.float32, seed=0), **blocks)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        sender.close()
        listener.close()
        for c in accepted:
            c.close()
    assert len(accepted) == 1  # the second push did not dial
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(buffer_prefix())]


def test_a_stalled_sender_ends_its_push() -> None:
    node = Receiver()
    node.data.stop()
    node.data = TcpKVServer(node.pool, FP, on_received=node.received.append, reservation_for=node.reservations.get,
                            begin_push=node._begin, end_push=node.in_flight.remove,
                            on_outcome=lambda ok, nbytes, s: node.outcomes.append(ok), stall_timeout_s=0.2)
    port = node.data.start()
    try:
        node.reservations["r"] = Reservation(0, (6,), (), TOKEN)
        stream = _stream(make_pool(node.pool.dtype, seed=9), [6], [3])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(stream[: len(stream) // 2])  # then nothing: the sender hangs
            assert wait_for(lambda: node.outcomes == [False], timeout=10)
            assert node.in_flight == []  # the reservation may be released again
    finally:
        node.close()


class _Broken:
    scheme = "tcp"

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code, self.calls = code, 0

    def push(self, endpoint, pool, **blocks):
        self.calls += 1
        raise TransferError(self.code, "injected")

    def close(self) -> None:
        pass


def test_fallback_order_and_what_falls_back(node: Receiver) -> None:
    src = make_pool(node.pool.dtype, seed=6)
    blocks = dict(request_id="r", fingerprint=FP, src_block_ids=[1], block_hashes=[], num_tokens=2,
                  dest_block_ids=[4], token=TOKEN, timeout=10)
    node.reservations["r"] = Reservation(0, (4,), (), TOKEN)
    real = FallbackKVSender([TcpKVSender()], GrpcKVSender())
    try:
        assert real.push(node.address, src, endpoints=[node.endpoint], **blocks).transport == "tcp"
        # Unknown schemes are skipped; an unreachable data port falls back to gRPC.
        got = real.push(node.address, src, endpoints=["rdma://x", "tcp://127.0.0.1:1"], **blocks)
        assert got.transport == "grpc" and real.num_fallbacks == 1
        assert real.push(node.address, src, **blocks).transport == "grpc"  # nothing advertised
    finally:
        real.close()
    assert torch.equal(node.pool[:, 4], src[:, 1])

    for code in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
        fallback = FallbackKVSender([_Broken(code)], GrpcKVSender())
        assert fallback.push(node.address, src, endpoints=[node.endpoint], **blocks).transport == "grpc"
        fallback.close()
    refused = _Broken(grpc.StatusCode.NOT_FOUND)  # the receiver's verdict: gRPC would hear the same
    with pytest.raises(TransferError):
        FallbackKVSender([refused], GrpcKVSender()).push("127.0.0.1:1", src, endpoints=[node.endpoint], **blocks)
    assert refused.calls == 1


def test_shm_round_trip_bit_exact_and_buffer_growth(node: Receiver) -> None:
    endpoint = shm_endpoint(f"127.0.0.1:{node.data.port}")
    assert parse_shm_endpoint(endpoint)[1:] == ("127.0.0.1", node.data.port)
    src = make_pool(node.pool.dtype, seed=7)
    sender = ShmKVSender(chunk_bytes=700)  # several chunks, each its own region of the buffer
    try:
        node.reservations["a"] = Reservation(0, (5, 0, 11), (1, 2), TOKEN)
        sender.push(endpoint, src, request_id="a", fingerprint=FP, src_block_ids=[7, 2, 9], block_hashes=[1, 2],
                    num_tokens=3 * BLOCK_SIZE - 2, dest_block_ids=[5, 0, 11], token=TOKEN, layers=range(1, 4),
                    timeout=10)
        node.reservations["b"] = Reservation(0, (3,), (), TOKEN)
        sender.push(endpoint, src, request_id="b", fingerprint=FP, src_block_ids=[1], block_hashes=[],
                    num_tokens=2, dest_block_ids=[3], token=TOKEN, timeout=10)
    finally:
        sender.close()
    expected = node.before.clone()
    expected[1:4, [5, 0, 11]] = src[1:4, [7, 2, 9]]
    expected[:, 3] = src[:, 1]
    assert torch.equal(node.pool, expected)
    assert node.data.connections_accepted == 1 and node.outcomes == [True, True]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(buffer_prefix())]  # unlinked once attached


def test_shm_is_skipped_for_another_host_and_refused_paths(node: Receiver) -> None:
    src = make_pool(node.pool.dtype, seed=8)
    node.reservations["r"] = Reservation(0, (4,), (), TOKEN)
    blocks = dict(request_id="r", fingerprint=FP, src_block_ids=[1], block_hashes=[], num_tokens=2,
                  dest_block_ids=[4], token=TOKEN, timeout=10)
    other_host = f"shm://not-this-boot/127.0.0.1:{node.data.port}"
    sender = FallbackKVSender([ShmKVSender(), TcpKVSender()], GrpcKVSender())
    try:
        got = sender.push(node.address, src, endpoints=[other_host, node.endpoint], **blocks)
    finally:
        sender.close()
    assert got.transport == "tcp" and node.data.connections_accepted == 1  # shm never dialled
    with socket.create_connection(("127.0.0.1", node.data.port), timeout=10) as sock:
        for path in ("/etc/passwd", "/dev/shm/../etc/pdserve-kv-1", "/dev/shm/pdserve-kv-nothere"):
            attach = kv_pb2.KVAttach(path=path, size=4096, request_id="r", token=TOKEN)  # authenticated
            sock.sendall(frame(kv_pb2.KVBlockMessage(attach=attach)))
            assert _reply(sock).WhichOneof("kind") == "error"
        unit = PoolLayout.of(src).block_bytes
        chunk = kv_pb2.KVChunk(seq=0, raw_bytes=unit, checksum=0, shm_offset=0)  # nothing attached
        header = build_header(request_id="r", fingerprint=FP, layout=PoolLayout.of(src), dest_block_ids=[4],
                              block_hashes=[], num_tokens=2, layers=range(SHAPE[0]), token=TOKEN)
        sock.sendall(frame(kv_pb2.KVBlockMessage(header=header)) + frame(kv_pb2.KVBlockMessage(chunk=chunk)))
        assert "shm_offset" in _reply(sock).error.message
    assert torch.equal(node.pool[:, 4], src[:, 1]) and len(node.received) == 1


def _mapped(path: str) -> bool:
    """Whether this process (the receiver runs in it) has ``path`` mapped."""
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith((path, f"{path} (deleted)")) for line in f)


def test_a_peer_without_the_token_writes_nothing_and_maps_nothing(node: Receiver) -> None:
    """A peer that knows the request id but not its reservation's token: refused over tcp
    (UNAUTHENTICATED without one, PERMISSION_DENIED with another) and over shm, where the
    receiver opens no file for it; the pool is untouched. The right token then goes through
    on both, over the same endpoints."""
    src = make_pool(node.pool.dtype, seed=10)
    node.reservations["r"] = Reservation(0, (4,), (), TOKEN)
    blocks = dict(request_id="r", fingerprint=FP, src_block_ids=[1], block_hashes=[], num_tokens=2,
                  dest_block_ids=[4], timeout=10)
    shm_ep = shm_endpoint(f"127.0.0.1:{node.data.port}")
    tcp, shm = TcpKVSender(), ShmKVSender()
    try:
        for sender, endpoint in ((tcp, node.endpoint), (shm, shm_ep)):
            for token, code in ((b"", grpc.StatusCode.UNAUTHENTICATED), (new_token(), grpc.StatusCode.PERMISSION_DENIED)):
                with pytest.raises(TransferError) as err:
                    sender.push(endpoint, src, token=token, **blocks)
                assert err.value.code == code, (endpoint, err.value)
                assert TOKEN.hex() not in err.value.details and repr(TOKEN) not in err.value.details
        assert node.unchanged() and not node.in_flight

        # A hand-made attach naming a real buffer file: refused before the file is opened.
        path = f"/dev/shm/{buffer_prefix()}tokentest"
        with open(path, "wb") as f:
            f.truncate(4096)
        try:
            with socket.create_connection(("127.0.0.1", node.data.port), timeout=10) as sock:
                attach = kv_pb2.KVAttach(path=path, size=4096, request_id="r", token=new_token())
                sock.sendall(frame(kv_pb2.KVBlockMessage(attach=attach)))
                assert _reply(sock).error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
                assert sock.recv(1) == b""  # and the connection is closed
            assert not _mapped(path)
            with socket.create_connection(("127.0.0.1", node.data.port), timeout=10) as sock:
                attach = kv_pb2.KVAttach(path=path, size=4096, request_id="r", token=TOKEN)
                sock.sendall(frame(kv_pb2.KVBlockMessage(attach=attach)))
                assert _reply(sock).WhichOneof("kind") == "ok"
                assert wait_for(lambda: _mapped(path), timeout=5)  # the control: an attach does map
        finally:
            os.unlink(path)

        assert tcp.push(node.endpoint, src, token=TOKEN, **blocks).blocks_written == 1
        assert shm.push(shm_ep, src, token=TOKEN, **blocks).blocks_written == 1  # not given up on
    finally:
        tcp.close()
        shm.close()
    assert torch.equal(node.pool[:, 4], src[:, 1]) and len(node.received) == 2


# ---- live nodes: a tiny model on in-process prefill and decode servers (tests/test_nodes.py's Cluster)


@pytest.fixture()
def cluster(tiny_dir, redis_url):
    from tests.test_nodes import Cluster

    c = Cluster(tiny_dir, redis_url)
    yield c
    c.close()


def test_nodes_move_kv_over_tcp_and_fall_back_to_grpc(tiny_dir, cluster) -> None:
    from tests.helpers import tokens_of
    from tests.test_nodes import GREEDY, make_engine

    prompt = list(range(20, 58))
    ref = make_engine(tiny_dir).generate([prompt], GREEDY)[0].outputs[0].token_ids
    res, pre, msgs = cluster.disaggregated("over-shm", prompt, GREEDY)
    port = cluster.decode.data_server.port
    assert tuple(res.kv_endpoints) == (shm_endpoint(f"127.0.0.1:{port}"), f"tcp://127.0.0.1:{port}")
    assert cluster.reader.live_nodes()["d0"].kv_endpoints == tuple(res.kv_endpoints)  # in the index too
    assert tokens_of(msgs) == ref and pre.blocks_sent == len(res.block_ids) and pre.transport == "shm"
    assert cluster.decode.data_server.connections_accepted == 1 and cluster.prefill.kv_sender.num_fallbacks == 0
    assert pre.kv_fallbacks == 0 and pre.transfer_s > 0
    # The prefill node advertises what it sends over; the router's guess for the pair agrees.
    from kv_transfer.shm_transport import host_key
    from router.cost_model import first_transport

    sends = cluster.reader.live_nodes()["p0"].kv_endpoints
    assert sends == (f"shm://{host_key()}/", "tcp://")
    assert first_transport(sends, res.kv_endpoints) == "shm"

    cluster.decode.data_server.stop()  # the data port dies; gRPC still answers
    res, pre, msgs = cluster.disaggregated("over-grpc", prompt, GREEDY)
    assert tokens_of(msgs) == ref and pre.blocks_sent == len(res.block_ids)
    assert cluster.prefill.kv_sender.num_fallbacks == 2 and pre.transport == "grpc"  # shm, tcp, then gRPC
    assert pre.kv_fallbacks == 2 and pre.transfer_s > 0  # the gRPC attempt's time alone
    assert cluster.free_blocks(cluster.decode) == cluster.decode.engine.num_blocks


def test_partial_transfer_blocks_are_freed(tiny_dir, cluster) -> None:
    """A data stream that breaks after writing some blocks: the request is not admitted on
    them, and the blocks come back whether the router recomputes or releases."""
    from tests.helpers import tokens_of
    from tests.test_nodes import GREEDY, make_engine

    node = cluster.decode
    total = node.engine.num_blocks
    src = torch.randn_like(node.engine.kv_cache)
    layout = PoolLayout.of(src)
    failures = node.num_transfer_failures
    for rid, then, first_token in (("recompute", "decode", 60), ("release", "release", 160)):
        prompt = list(range(first_token, first_token + 23))  # 6 blocks of 4, none cached yet
        res = cluster.reserve(rid, prompt)
        assert cluster.free_blocks(node) == total - len(res.block_ids)
        header = build_header(
            request_id=rid, fingerprint=cluster.fp, layout=layout, dest_block_ids=list(res.block_ids),
            block_hashes=cluster.hashes(prompt), num_tokens=len(prompt), layers=range(layout.num_layers),
            token=res.token, checksum_algorithm=kv_pb2.CHECKSUM_ALGORITHM_XXH3_64)
        units = payload_units(src, list(range(len(res.block_ids))), range(layout.num_layers))
        data = b"".join(u.tobytes() for u in units[: len(units) // 2])
        c = new_checksum(header.checksum_algorithm)
        c.update(data)
        with socket.create_connection(("127.0.0.1", node.data_server.port), timeout=10) as sock:
            # Half the payload in one good chunk (written), then the sender dies mid-stream.
            sock.sendall(frame(kv_pb2.KVBlockMessage(header=header))
                         + frame(kv_pb2.KVBlockMessage(chunk=kv_pb2.KVChunk(seq=0, raw_bytes=len(data),
                                                                             checksum=c.value()))) + data)
        # Counted after the receiver ended the push (its blocks may be released from then on).
        assert wait_for(lambda: node.num_transfer_failures == failures + 1, timeout=10)
        failures += 1
        with pytest.raises(grpc.RpcError) as err:  # the KV is incomplete: never admitted on it
            cluster.decode_rpc(rid, prompt, GREEDY, first=[5])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        if then == "decode":  # the router's fallback: the decode node recomputes the prompt
            ref = make_engine(tiny_dir).generate([prompt], GREEDY)[0].outputs[0].token_ids
            assert tokens_of(cluster.decode_rpc(rid, prompt, GREEDY)) == ref
        else:
            assert cluster.kv_stub.ReleaseReservation(kv_pb2.ReleaseReservationRequest(request_id=rid)).found
        assert cluster.free_blocks(node) == total


def test_transfer_bench_quick_reports_every_transport() -> None:
    import json
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "transfer", "--quick", "--json"],
                       cwd=repo, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bit_exact"] is True
    assert set(out["transports"]) == {"grpc", "tcp", "shm", "dist"}
    for t, v in out["transports"].items():
        assert v["gbps"] > 0 and v["ceiling_gbps"] > 0 and abs(v["ratio"] - v["gbps"] / v["ceiling_gbps"]) < 0.01, t
    assert out["transports"]["dist"]["ceiling"] == "socket" and out["transports"]["dist"]["setup_ms"] > 0
    assert set(out["fixed_ms"]) == {"grpc", "tcp", "shm", "dist"} and set(out["latency_ms"]) == {"1", "4", "16"}
    # Layer-wise streaming on live nodes (tiny model in --quick): both ways ran, the figures are there.
    assert out["overlap"] <= 1 and out["ttft_streaming_s"] > 0 and out["ttft_after_prefill_s"] > 0
    st = out["streaming"]
    assert st["all_streamed"] and st["on"]["pushes"] >= 1 and st["off"]["pushes"] == 1
    assert st["off"]["transfer_s"] > 0 and st["transport"] == "shm"


def test_row_views_merge_consecutive_rows_in_payload_order() -> None:
    rows = np.arange(10 * 4, dtype=np.uint8).reshape(10, 4)  # [rows, row_bytes]
    views = row_views(rows, np.array([3, 4, 5, 9, 2, 3]))
    assert [bytes(v) for v in views] == [rows[3:6].tobytes(), rows[9:10].tobytes(), rows[2:4].tobytes()]
    views[1][:] = b"\xff" * 4  # writable, and into the pool itself
    assert rows[9].tolist() == [255] * 4
