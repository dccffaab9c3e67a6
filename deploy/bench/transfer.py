"""`pdserve bench transfer`: KV blocks pool -> gRPC -> pool, against raw loopback TCP.

Both paths move the same bytes in the same run on 127.0.0.1:
  grpc:   kv_transfer.push_blocks (gather, CRC32, 1 MiB chunks) -> KVReceiver (validate,
          buffer, CRC32, one index_copy_ into the destination pool), answered after the write.
  socket: the already-gathered payload with sendall -> recv_into a preallocated buffer; no
          gather, checksum, validation or scatter: the bound a byte-moving transport can reach.
Throughput is in gigabytes per second (1e9 bytes/s), median over repeats.

The KV has SmolLM2-135M's shape: 30 layers, 3 KV heads, head_dim 64, block 16, float32, so one
block of 16 tokens over all layers is 737,280 bytes.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from concurrent import futures

import grpc
import torch

from kv_transfer.grpc_transport import GRPC_OPTIONS, KVReceiver, push_blocks
from kv_transfer.validate import Reservation
from kv_transfer.wire import payload_units
from protos.pdserve.v1 import kv_pb2_grpc

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
FINGERPRINT = "bench-smollm2-135m-shape"
GB = 1e9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes-mib", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="request KV sizes (MiB)"
    )
    parser.add_argument("--seconds-per-size", type=float, default=2.0, help="time budget per size and path")
    parser.add_argument("--plot", metavar="FILE.png", help="draw throughput vs size for both paths")


def _blocks_for(size_mib: int, block_bytes: int) -> int:
    return max(1, round(size_mib * (1 << 20) / block_bytes))


def _timed_repeats(fn, budget_s: float, min_reps: int = 3, max_reps: int = 50) -> list[float]:
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < min_reps or (time.perf_counter() < deadline and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


class _SocketPair:
    """A loopback TCP connection whose receiving end recv_into's a buffer in a thread."""

    def __init__(self) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self.send_sock = socket.create_connection(listener.getsockname())
        self.recv_sock, _ = listener.accept()
        listener.close()
        for s in (self.send_sock, self.recv_sock):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def transfer(self, payload: bytes, out: bytearray) -> None:
        """Send payload, receive it into out (preallocated and reused: no page faults)."""

        def receive() -> None:
            view, got = memoryview(out), 0
            while got < len(out):
                n = self.recv_sock.recv_into(view[got:])
                if n == 0:
                    raise ConnectionError("socket closed mid-transfer")
                got += n

        reader = threading.Thread(target=receive)
        reader.start()
        self.send_sock.sendall(payload)
        reader.join()

    def close(self) -> None:
        self.send_sock.close()
        self.recv_sock.close()


def run(args: argparse.Namespace, report) -> dict:
    block_bytes_all_layers = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
    sizes = [(mib, _blocks_for(mib, block_bytes_all_layers)) for mib in args.sizes_mib]
    max_blocks = max(n for _, n in sizes)
    num_blocks = 2 * max_blocks + 8
    gen = torch.Generator().manual_seed(0)
    shape = (NUM_LAYERS, num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    src_pool = torch.randn(shape, generator=gen)  # [layers, blocks, 2, block, heads, dim]
    dst_pool = torch.zeros(shape)
    report.progress(f"pools {tuple(shape)} float32, {block_bytes_all_layers} bytes per block (all layers)")

    reservations: dict[str, Reservation] = {}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    kv_pb2_grpc.add_KVTransferServicer_to_server(
        KVReceiver(dst_pool, FINGERPRINT, on_received=lambda r: None, reservation_for=reservations.get), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    sockets = _SocketPair()

    rows, per_size, bit_exact = [], [], True
    try:
        for mib, n in sizes:
            # Non-contiguous, shuffled ids on both sides, as a real block table would have.
            src_ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()
            dst_ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()
            num_tokens = n * BLOCK_SIZE
            hashes = list(range(1, n + 1))
            rid = f"bench-{mib}"
            reservations[rid] = Reservation(0, tuple(dst_ids), tuple(hashes))
            nbytes = n * block_bytes_all_layers

            def grpc_once() -> None:
                push_blocks(
                    channel, src_pool, request_id=rid, fingerprint=FINGERPRINT, src_block_ids=src_ids,
                    block_hashes=hashes, num_tokens=num_tokens, dest_block_ids=dst_ids,
                )

            payload = b"".join(payload_units(src_pool, src_ids, range(NUM_LAYERS)))  # the same bytes
            out = bytearray(len(payload))
            grpc_times = _timed_repeats(grpc_once, args.seconds_per_size)
            sock_times = _timed_repeats(lambda: sockets.transfer(payload, out), args.seconds_per_size / 2)
            exact = torch.equal(dst_pool[:, dst_ids], src_pool[:, src_ids])
            sock_exact = out == payload
            bit_exact = bit_exact and exact and sock_exact
            g = nbytes / statistics.median(grpc_times) / GB
            s = nbytes / statistics.median(sock_times) / GB
            per_size.append(
                {"mib": mib, "blocks": n, "bytes": nbytes, "gbps": round(g, 3), "socket_gbps": round(s, 3),
                 "ratio": round(g / s, 3), "grpc_reps": len(grpc_times), "socket_reps": len(sock_times),
                 "bit_exact": exact}
            )
            rows.append([nbytes / (1 << 20), n, g, s, g / s, exact])
            report.progress(f"{mib} MiB: grpc {g:.2f} GB/s, socket {s:.2f} GB/s")
    finally:
        sockets.close()
        channel.close()
        server.stop(grace=None)

    report.table(["MiB", "blocks", "grpc GB/s", "socket GB/s", "ratio", "bit_exact"], rows)
    # Headline: total bytes over total median time across sizes (large sizes dominate).
    total = sum(p["bytes"] for p in per_size)
    gbps = total / sum(p["bytes"] / (p["gbps"] * GB) for p in per_size) / GB
    socket_gbps = total / sum(p["bytes"] / (p["socket_gbps"] * GB) for p in per_size) / GB
    if args.plot:
        _plot(per_size, args.plot)
        report.progress(f"plot written to {args.plot}")
    return {
        "unit": "gigabytes per second (1e9 bytes/s)",
        "gbps": round(gbps, 3),
        "socket_gbps": round(socket_gbps, 3),
        "ratio": round(gbps / socket_gbps, 3),
        "bit_exact": bit_exact,
        "per_size": per_size,
    }


def _plot(per_size: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = [p["bytes"] / (1 << 20) for p in per_size]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(mib, [p["gbps"] for p in per_size], marker="o", label="gRPC pool -> pool (kv_transfer)")
    ax.plot(mib, [p["socket_gbps"] for p in per_size], marker="s", label="raw TCP socket (bytes only)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("request KV size (MiB)")
    ax.set_ylabel("GB/s (1e9 bytes/s)")
    ax.set_title("KV transfer on loopback, SmolLM2-135M KV shape")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
