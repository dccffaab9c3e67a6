"""The dist transport (kv_transfer/dist_transport.py, dist_group.py) between two real processes on
127.0.0.1: the receiver is the transfer bench's receiving process (a decode node's data port
and gRPC receiver, with process groups on), the sender this process, over real gloo groups.
Bit-exact pushes, layer-range pushes, a group reused across transfers and dropped after a
failure, refusals (a corrupted chunk, a wrong token) that land nothing, and a receiver frozen
(SIGSTOP) or killed (SIGKILL) mid-push: the push fails within its bound and FallbackKVSender
carries it over gRPC instead (or, for the dead one, to nothing, within its bound)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import torch
import xxhash

from kv_transfer.dist_group import PairGroup
from kv_transfer.dist_transport import DistKVSender, dist_endpoint, parse_dist_endpoint
from kv_transfer.grpc_transport import GrpcKVSender
from kv_transfer.tcp_transport import TcpKVSender
from kv_transfer.transport import TRANSPORT_FAILURES, FallbackKVSender, TransferError
from kv_transfer.validate import new_token
from tests.helpers import REPO

# [layers, blocks, 2, block, heads, dim] float32: 2 KiB per block-layer, 16 KiB per block.
SHAPE = (8, 40, 2, 4, 4, 8)
FP = "bench"  # the receiving process's fingerprint


class ReceiverProcess:
    """bench/transfer_receiver.py in a child process: reserve, digest, freeze, kill."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.transfer_receiver", "--shape", *map(str, SHAPE)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ports = json.loads(self.proc.stdout.readline())
        self.address = f"127.0.0.1:{ports['grpc']}"
        self.endpoint = dist_endpoint(f"127.0.0.1:{ports['data']}")
        self.tcp_endpoint = f"tcp://127.0.0.1:{ports['data']}"

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def reserve(self, rid: str, dest: list[int], token: bytes) -> None:
        self.ask(reserve=rid, first=0, dest=dest, hashes=list(range(1, len(dest) + 1)), token=token.hex())

    def digest(self, block_ids: list[int]) -> str:
        return self.ask(digest=block_ids)["xxh3"]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def receiver():
    r = ReceiverProcess()
    yield r
    r.close()


@pytest.fixture()
def sender():
    s = DistKVSender(chunk_bytes=20_000)  # several chunks (and both staging buffers) per transfer
    yield s
    s.close()


def src_pool(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def digest_of(pool: torch.Tensor, ids: list[int], layers: range | None = None) -> str:
    blocks = pool[:, ids] if layers is None else pool[layers.start : layers.stop, ids]
    return xxhash.xxh3_64(blocks.contiguous().numpy().tobytes()).hexdigest()


def blocks_for(rid: str, src: list[int], dest: list[int], token: bytes, **kw) -> dict:
    return dict(request_id=rid, fingerprint=FP, src_block_ids=src, block_hashes=list(range(1, len(src) + 1)),
                num_tokens=len(src) * SHAPE[3],
                dest_block_ids=dest, token=token, timeout=20, **kw)


def test_endpoints_parse() -> None:
    assert parse_dist_endpoint("dist://[::1]:7") == ("::1", 7)
    with pytest.raises(ValueError):
        parse_dist_endpoint("tcp://h:1")


def test_pushes_land_bit_exact_and_reuse_the_pairs_group(receiver: ReceiverProcess, sender: DistKVSender) -> None:
    pool = src_pool(1)
    for i, (src, dest) in enumerate([([3, 1, 7, 8, 9], [10, 11, 2, 30, 31]), ([0, 5], [20, 6])]):
        token = new_token()
        receiver.reserve(f"ok{i}", dest, token)
        got = sender.push(receiver.endpoint, pool, **blocks_for(f"ok{i}", src, dest, token))
        assert got.blocks_written == len(dest) and got.bytes_written == pool[:, src].numel() * 4
        assert receiver.digest(dest) == digest_of(pool, src)
    assert sender.groups_made == 1 and sender.groups_dropped == 0  # one group, reused
    assert 0 < sender.setup_s_total < 5


def test_layer_ranges_stream_into_one_reservation(receiver: ReceiverProcess, sender: DistKVSender) -> None:
    pool, token, src, dest = src_pool(2), new_token(), [4, 2, 6], [33, 34, 35]
    receiver.reserve("layers", dest, token)
    for layers in (range(0, 3), range(3, 8)):  # as a streaming prefill pushes them
        sender.push(receiver.endpoint, pool, **blocks_for("layers", src, dest, token, layers=layers))
    assert receiver.digest(dest) == digest_of(pool, src)


def test_wrong_token_and_corrupted_chunk_are_refused_and_nothing_lands(
        receiver: ReceiverProcess, sender: DistKVSender, monkeypatch) -> None:
    pool, token, src, dest = src_pool(3), new_token(), [1, 2, 3], [12, 13, 14]
    receiver.reserve("refuse", dest, token)
    before = receiver.digest(dest)
    with pytest.raises(TransferError) as err:  # refused at the attach: no group for a stranger
        sender.push(receiver.endpoint, pool, **blocks_for("refuse", src, dest, new_token()))
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and sender.groups_made == 0

    real_send = PairGroup.send

    def corrupted(self, data):  # one byte of every chunk flipped on the wire, after its checksum
        data[len(data) // 2] ^= 0xFF
        return real_send(self, data)

    monkeypatch.setattr(PairGroup, "send", corrupted)
    with pytest.raises(TransferError) as err:
        sender.push(receiver.endpoint, pool, **blocks_for("refuse", src, dest, token))
    assert err.value.code == grpc.StatusCode.DATA_LOSS
    # The first chunk failed its check before it was scattered: nothing landed.
    assert receiver.digest(dest) == before
    monkeypatch.setattr(PairGroup, "send", real_send)
    # The group stayed in step (the refused transfer's chunks were drained): the next lands.
    sender.push(receiver.endpoint, pool, **blocks_for("refuse", src, dest, token))
    assert receiver.digest(dest) == digest_of(pool, src) and sender.groups_made == 1


def test_header_refused_on_a_kept_group_does_not_block_the_sender(receiver: ReceiverProcess) -> None:
    pool, token, src, dest = src_pool(4), new_token(), [1, 2], [15, 16]
    receiver.reserve("kept", dest, token)
    s = DistKVSender(chunk_bytes=20_000)
    try:
        s.push(receiver.endpoint, pool, **blocks_for("kept", src, dest, token))
        t0 = time.monotonic()
        with pytest.raises(TransferError) as err:  # the header's token is wrong: its chunks are drained
            s.push(receiver.endpoint, pool, **blocks_for("kept", src, dest, new_token()))
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and time.monotonic() - t0 < 2
        with pytest.raises(TransferError) as err:  # no such reservation
            s.push(receiver.endpoint, pool, **blocks_for("nobody", src, dest, token))
        assert err.value.code == grpc.StatusCode.NOT_FOUND
    finally:
        s.close()


def _push_in_thread(fallback: FallbackKVSender, address: str, pool, endpoints, blocks) -> dict:
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["result"] = fallback.push(address, pool, endpoints=endpoints, **blocks)
        except TransferError as err:
            out["error"] = err
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    out["thread"] = t
    return out


def test_a_frozen_receiver_fails_the_push_in_bound_and_it_falls_back(receiver: ReceiverProcess) -> None:
    """SIGSTOP mid-push: the group's sends stop completing, the push fails after the progress
    timeout, the group is dropped, and gRPC lands the blocks once the receiver runs again."""
    pool, token = src_pool(5), new_token()
    src, dest = list(range(0, 30)), list(range(0, 30))  # 480 KiB: 24 group sends of 20 kB
    receiver.reserve("frozen", dest, token)
    dist = DistKVSender(chunk_bytes=20_000, progress_timeout_s=1.0)
    fallback = FallbackKVSender([dist], GrpcKVSender())
    blocks = blocks_for("frozen", src, dest, token)
    try:
        dist.push(receiver.endpoint, pool, **blocks_for("frozen", [0], [0], token))  # the group exists
        os.kill(receiver.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(TransferError) as err:
                dist.push(receiver.endpoint, pool, **blocks)
            assert err.value.code in TRANSPORT_FAILURES and time.monotonic() - t0 < 4
            assert dist.groups_dropped == 1
            # Through the fallback: dist fails again (a fresh group cannot form), then gRPC.
            out = _push_in_thread(fallback, receiver.address, pool, [receiver.endpoint], blocks)
            time.sleep(1.5)
        finally:
            os.kill(receiver.proc.pid, signal.SIGCONT)
        out["thread"].join(30)
        assert "error" not in out, out.get("error")
        assert out["result"].transport == "grpc" and out["result"].fallbacks == 1
        assert receiver.digest(dest) == digest_of(pool, src)
        # The dropped group is not reused: the next push over dist makes a new one.
        dist.push(receiver.endpoint, pool, **blocks)
        assert dist.groups_made == 2 and receiver.digest(dest) == digest_of(pool, src)
    finally:
        fallback.close()


def test_a_killed_receiver_fails_the_push_in_bound_and_it_falls_back() -> None:
    """SIGKILL mid-push: the dist push fails at once with a transport failure, and the chain
    moves on (here to tcp on a second receiver process, bit-exact)."""
    dead, alive = ReceiverProcess(), ReceiverProcess()
    pool, token = src_pool(6), new_token()
    src, dest = list(range(0, 40)), list(range(0, 40))
    try:
        for r in (dead, alive):
            r.reserve("killed", dest, token)
        dist = DistKVSender(chunk_bytes=8_000)
        blocks = blocks_for("killed", src, dest, token)
        dist.push(dead.endpoint, pool, **blocks_for("killed", [0], [0], token))
        killer = threading.Timer(0.05, os.kill, (dead.proc.pid, signal.SIGKILL))
        t0 = time.monotonic()
        killer.start()
        try:
            for _ in range(200):  # push until the kill lands mid-push
                dist.push(dead.endpoint, pool, **blocks)
            pytest.fail("the receiver did not die")
        except TransferError as err:
            assert err.code in TRANSPORT_FAILURES and time.monotonic() - t0 < 8
        finally:
            killer.join()
        # A chain whose dist endpoint is dead: tcp carries it to the live receiver.
        chain = FallbackKVSender([dist, TcpKVSender()], GrpcKVSender())
        try:
            got = chain.push(alive.address, pool, endpoints=[dead.endpoint, alive.tcp_endpoint], **blocks)
        finally:
            chain.close()
        assert got.transport == "tcp" and got.fallbacks == 1
        assert alive.digest(dest) == digest_of(pool, src)
    finally:
        dead.close()
        alive.close()


def test_a_receiver_without_groups_is_passed_over(receiver: ReceiverProcess) -> None:
    """A data port without --kv-dist answers the attach UNAVAILABLE: a transport failure."""
    from kv_transfer.receiver import TcpKVServer
    from kv_transfer.validate import Reservation

    pool, token = src_pool(7), new_token()
    dst = torch.zeros(SHAPE)
    server = TcpKVServer(dst, FP, on_received=lambda r: None,
                         reservation_for={"r": Reservation(0, (1,), (), token)}.get)
    port = server.start()
    s = DistKVSender()
    try:
        with pytest.raises(TransferError) as err:
            s.push(f"dist://127.0.0.1:{port}", pool, **blocks_for("r", [2], [1], token))
        assert err.value.code in TRANSPORT_FAILURES
        assert np.all(dst.numpy() == 0)
    finally:
        s.close()
        server.stop()


def test_nodes_with_kv_dist_advertise_it_and_move_kv_over_it(tiny_dir, redis_url) -> None:
    """Two live nodes with NodeConfig.kv_dist: the decode node advertises dist:// between shm
    and tcp, the prefill node that it sends over it; shm still goes first on one host, and a
    prefill node without shm pushes over dist, the greedy output unchanged."""
    from kv_transfer.shm_transport import shm_endpoint
    from router.cost_model import first_transport
    from tests.helpers import tokens_of
    from tests.test_nodes import GREEDY, Cluster, make_engine

    c = Cluster(tiny_dir, redis_url, kv_dist=True)
    try:
        prompt = list(range(20, 58))
        ref = make_engine(tiny_dir).generate([prompt], GREEDY)[0].outputs[0].token_ids
        res, pre, msgs = c.disaggregated("first", prompt, GREEDY)
        address = f"127.0.0.1:{c.decode.data_server.port}"
        assert tuple(res.kv_endpoints) == (shm_endpoint(address), dist_endpoint(address), f"tcp://{address}")
        sends = c.reader.live_nodes()["p0"].kv_endpoints
        assert "dist://" in sends and pre.transport == "shm" and tokens_of(msgs) == ref
        assert first_transport(("dist://", "tcp://"), res.kv_endpoints) == "dist"
        c.prefill.kv_sender.close()
        c.prefill.kv_sender = FallbackKVSender([DistKVSender(), TcpKVSender()], GrpcKVSender())
        prompt = list(range(60, 98))
        ref = make_engine(tiny_dir).generate([prompt], GREEDY)[0].outputs[0].token_ids
        res, pre, msgs = c.disaggregated("second", prompt, GREEDY)
        assert pre.transport == "dist" and pre.kv_fallbacks == 0 and tokens_of(msgs) == ref
        assert c.decode.data_server.dist.groups_made == 1
        # Exported at scrape time: the decode node received one group (the test's own sender
        # replaced the prefill node's, whose counters stay at 0).
        m = c.decode.metrics
        assert m.registry.get_sample_value("pdserve:kv_dist_groups_total", {**m.labels, "side": "receive"}) == 1
        assert m.registry.get_sample_value("pdserve:kv_dist_group_setup_seconds_total",
                                           {**m.labels, "side": "receive"}) > 0
        assert m.registry.get_sample_value("pdserve:kv_dist_groups_dropped_total", m.labels) == 0
    finally:
        c.close()


def test_an_offered_group_nobody_joins_is_given_up_within_the_join_bound() -> None:
    """Groups form one at a time in a process: a sender that asked and went away holds the
    receiver's next join back only for JOIN_TIMEOUT_S, then the next pair forms."""
    from kv_transfer.dist_group import JOIN_TIMEOUT_S, DistRendezvous, sender_group
    from protos.pdserve.v1 import kv_pb2

    r = DistRendezvous("127.0.0.1")
    joined: dict = {}
    try:
        _, stale = r.offer()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            r.join(stale, "127.0.0.1")
        assert JOIN_TIMEOUT_S - 0.2 < time.monotonic() - t0 < JOIN_TIMEOUT_S + 2
        port, key = r.offer()
        t = threading.Thread(target=lambda: joined.setdefault("g", r.join(key, "127.0.0.1")))
        t.start()
        ready = kv_pb2.KVDistReady(store_port=port, group_key=key, timeout_ms=5000)
        s = sender_group("127.0.0.1", ready, "127.0.0.1")
        t.join(10)
        got = torch.empty(4, dtype=torch.uint8)
        work = joined["g"].recv(got)
        s.wait(s.send(torch.arange(4, dtype=torch.uint8)))
        joined["g"].wait(work)
        assert got.tolist() == [0, 1, 2, 3] and r.groups_made == 1
        s.close()
    finally:
        joined.clear()  # close waits for the groups still held to go
        r.close()
