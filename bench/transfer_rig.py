"""What `pdserve bench transfer` moves and where: the source pool, the receiving process
(bench/transfer_receiver.py), one sender per transport, and per transfer size a ``case``: a
reservation in the receiver and one callable per path.

``verify`` is the bit-exactness check, a pass of its own after the timing: every transport
writes the same bytes into the same destination blocks, so a digest taken once at the end
would see only the last writer. Per transport it clears the blocks (the receiver fills them
with a sentinel), pushes once, digests and compares with the source.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import grpc
import torch
import xxhash

from bench.transfer_receiver import RAW_LEN, RAW_MODES, SINK_METHOD, SINK_SERVICE, set_raw_options
from kv_transfer.dist_transport import DistKVSender, dist_endpoint
from kv_transfer.grpc_transport import KV_GRPC_OPTIONS, push_blocks
from kv_transfer.layout import PoolLayout
from kv_transfer.shm_transport import ShmKVSender, shm_endpoint
from kv_transfer.tcp_transport import TcpKVSender
from kv_transfer.validate import new_token
from kv_transfer.wire import build_header, iter_wire_messages, payload_units
from protos.pdserve.v1 import kv_pb2

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4  # one block, all layers, float32
FINGERPRINT = "bench"  # the receiver's
TRANSPORTS = ("grpc", "tcp", "shm", "dist")


class Receiver:
    """The receiving process and the ways to reach it."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.transfer_receiver", "--shape", *map(str, shape)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        ports = self._read()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}", options=KV_GRPC_OPTIONS)
        self.sink = self.channel.stream_unary(f"/{SINK_SERVICE}/{SINK_METHOD}")
        self.tcp_endpoint = f"tcp://127.0.0.1:{ports['data']}"
        self.shm_endpoint = shm_endpoint(f"127.0.0.1:{ports['data']}")
        self.dist_endpoint = dist_endpoint(f"127.0.0.1:{ports['data']}")
        # The raw-socket ceiling at its best: timed three ways (RAW_MODES: the kernel's default
        # socket options, the data port's 4 MiB buffers, and a cache-warm 1 MiB receive buffer
        # that places the bytes nowhere), the fastest per size. Before 2026-12-01 it had only
        # the first, which a chunked transport could beat.
        self.raw = {}
        for mode in RAW_MODES:
            sock = socket.create_connection(("127.0.0.1", ports[f"raw_{mode}"]))
            set_raw_options(sock, mode)
            self.raw[mode] = sock

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the receiving process exited (see its stderr above)")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def raw_transfer(self, payload: bytes, mode: str) -> None:
        sock = self.raw[mode]
        sock.sendall(RAW_LEN.pack(len(payload)))
        sock.sendall(payload)
        if sock.recv(1) != b"\x01":
            raise ConnectionError("raw receiver closed")

    def close(self) -> None:
        for sock in self.raw.values():
            sock.close()
        self.channel.close()
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class Rig:
    """A source pool of ``num_blocks`` blocks, the receiver (a pool of the same shape) and the
    four senders. ``case(n)`` reserves n blocks; ``verify(case)`` checks each transport."""

    def __init__(self, num_blocks: int, checksum: str = "xxh3_64", seed: int = 0) -> None:
        self.num_blocks = num_blocks
        self.gen = torch.Generator().manual_seed(seed)
        self.shape = (NUM_LAYERS, num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.src_pool = torch.randn(self.shape, generator=self.gen)  # [layers, blocks, 2, block, heads, dim]
        self.algorithm = kv_pb2.ChecksumAlgorithm.Value(f"CHECKSUM_ALGORITHM_{checksum.upper()}")
        self.receiver = Receiver(self.shape)
        self.tcp, self.shm, self.dist = TcpKVSender(), ShmKVSender(), DistKVSender()
        self._count = 0

    def case(self, n: int) -> dict:
        """A reservation of n blocks in the receiver and one callable per path; ``blocks`` is
        the push's keyword arguments, ``want`` the source blocks' digest."""
        src_ids = torch.randperm(self.num_blocks, generator=self.gen)[:n].tolist()  # shuffled, as a block table is
        dst_ids = torch.randperm(self.num_blocks, generator=self.gen)[:n].tolist()
        hashes = list(range(1, n + 1))
        rid = f"bench-{n}-{self._count}"
        self._count += 1
        token = new_token()
        self.receiver.ask(reserve=rid, first=0, dest=dst_ids, hashes=hashes, token=token.hex())
        blocks = dict(request_id=rid, fingerprint=FINGERPRINT, src_block_ids=src_ids, block_hashes=hashes,
                      num_tokens=n * BLOCK_SIZE, dest_block_ids=dst_ids, token=token,
                      checksum_algorithm=self.algorithm)
        pool, receiver = self.src_pool, self.receiver
        payload = b"".join(payload_units(pool, src_ids, range(NUM_LAYERS)))
        header = build_header(request_id=rid, fingerprint=FINGERPRINT, layout=PoolLayout.of(pool),
                              dest_block_ids=dst_ids, block_hashes=hashes, num_tokens=n * BLOCK_SIZE,
                              layers=range(NUM_LAYERS), checksum_algorithm=self.algorithm, token=token)
        serialized = list(iter_wire_messages(header, payload_units(pool, src_ids, range(NUM_LAYERS))))
        return {
            "src_ids": src_ids, "dst_ids": dst_ids, "bytes": len(payload), "payload": payload, "blocks": blocks,
            "want": xxhash.xxh3_64(pool[:, src_ids].contiguous().numpy().tobytes()).hexdigest(),
            "grpc": lambda: push_blocks(receiver.channel, pool, **blocks),
            "tcp": lambda: self.tcp.push(receiver.tcp_endpoint, pool, **blocks),
            "shm": lambda: self.shm.push(receiver.shm_endpoint, pool, **blocks),
            "dist": lambda: self.dist.push(receiver.dist_endpoint, pool, **blocks),
            **{f"socket_{mode}": (lambda mode=mode: receiver.raw_transfer(payload, mode)) for mode in RAW_MODES},
            "grpc_bytes": lambda: receiver.sink(iter(serialized)),
        }

    def verify(self, case: dict, transports: tuple[str, ...] = TRANSPORTS) -> dict[str, bool]:
        """Per transport: clear the destination blocks, push once, digest, compare with the
        source."""
        out = {}
        for t in transports:
            self.receiver.ask(clear=case["dst_ids"])
            case[t]()
            out[t] = self.receiver.ask(digest=case["dst_ids"])["xxh3"] == case["want"]
        return out

    def close(self) -> None:
        for sender in (self.tcp, self.shm, self.dist):
            sender.close()
        self.receiver.close()


def exact_by_transport(checks: list[dict[str, bool]]) -> dict[str, bool]:
    """Each transport's verdict over several ``verify`` results: all of its checks passed."""
    names = dict.fromkeys(t for c in checks for t in c)
    return {t: all(c[t] for c in checks if t in c) for t in names}

