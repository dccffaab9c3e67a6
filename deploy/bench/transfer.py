"""`pdserve bench transfer`: KV blocks pool -> gRPC -> pool, against raw loopback TCP.

All paths move the same bytes in the same run on 127.0.0.1, their repeats interleaved so they
see the same machine load:
  grpc:       kv_transfer.push_blocks (chunks joined from the pool, checksummed) -> KVReceiver
              (header validation, buffering, checksum, one index_copy_ into the destination
              pool), answered after the write; --checksum picks the payload checksum
              (default XXH3-64, what nodes use). This is the figure the project claims.
  socket:     the same payload bytes, sendall -> recv_into a preallocated buffer in a thread;
              no gather, checksum, validation or scatter: what a byte-moving transport can reach.
  grpc_bytes: diagnostic. The same serialized KVBlockMessages into a handler that only reads
              them: what gRPC Python itself allows, so grpc / grpc_bytes is kv_transfer's own
              overhead and grpc_bytes / socket is gRPC's.
Throughput is in gigabytes per second (1e9 bytes/s), from each size's median time. Headline
figures weigh sizes by bytes: all bytes over the sum of the per-size median times.

``components`` times two choices of the receiver on 64 MiB, in the same run: each checksum
algorithm's throughput (GiB/s), and filling a fresh receive buffer vs a reused one (a fresh one
takes a page fault per 4 KiB, the reason kv_transfer/buffers.py keeps warm ones).

The KV has SmolLM2-135M's shape: 30 layers, 3 KV heads, head_dim 64, block 16, float32, so one
block of 16 tokens over all layers is 737,280 bytes.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import torch

from kv_transfer import checksum as checksums
from kv_transfer.grpc_transport import KV_GRPC_OPTIONS, KVReceiver, push_blocks
from kv_transfer.layout import PoolLayout
from kv_transfer.validate import Reservation
from kv_transfer.wire import build_header, iter_wire_messages, payload_units
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
FINGERPRINT = "bench-smollm2-135m-shape"
GB = 1e9
# Bench-only method for the grpc_bytes diagnostic (not part of the protos' API).
_SINK_SERVICE, _SINK_METHOD = "pdserve.bench.Sink", "PushBlocks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes-mib", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="request KV sizes (MiB)"
    )
    parser.add_argument("--seconds-per-size", type=float, default=5.0, help="time budget per size (all paths)")
    parser.add_argument(
        "--checksum", choices=["crc32", "xxh3_64"], default="xxh3_64",
        help="payload checksum of the grpc path (the default is what nodes use)",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw throughput vs size for the paths")


def _blocks_for(size_mib: int, block_bytes: int) -> int:
    return max(1, round(size_mib * (1 << 20) / block_bytes))


def _interleaved_times(
    fns: list[Callable[[], None]], budget_s: float, min_reps: int = 5, max_reps: int = 60
) -> list[list[float]]:
    """Time each fn in turn, round after round, so all see the same machine load (shared VMs)."""
    times: list[list[float]] = [[] for _ in fns]
    deadline = time.perf_counter() + budget_s
    while len(times[0]) < min_reps or (time.perf_counter() < deadline and len(times[0]) < max_reps):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
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


def _sink(request_iterator, context) -> bytes:
    for _ in request_iterator:  # read every message, keep nothing
        pass
    return kv_pb2.PushBlocksResponse().SerializeToString()


def run(args: argparse.Namespace, report) -> dict:
    block_bytes_all_layers = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
    sizes = [(mib, _blocks_for(mib, block_bytes_all_layers)) for mib in args.sizes_mib]
    num_blocks = 2 * max(n for _, n in sizes) + 8
    gen = torch.Generator().manual_seed(0)
    shape = (NUM_LAYERS, num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    src_pool = torch.randn(shape, generator=gen)  # [layers, blocks, 2, block, heads, dim]
    dst_pool = torch.zeros(shape)
    algorithm = kv_pb2.ChecksumAlgorithm.Value(f"CHECKSUM_ALGORITHM_{args.checksum.upper()}")
    report.progress(
        f"pools {tuple(shape)} float32, {block_bytes_all_layers} bytes per block (all layers), "
        f"checksum {args.checksum}"
    )

    reservations: dict[str, Reservation] = {}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=KV_GRPC_OPTIONS)
    kv_pb2_grpc.add_KVTransferServicer_to_server(
        KVReceiver(dst_pool, FINGERPRINT, on_received=lambda r: None, reservation_for=reservations.get), server
    )
    sink = grpc.stream_unary_rpc_method_handler(_sink)  # no (de)serializers: bytes in, bytes out
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SINK_SERVICE, {_SINK_METHOD: sink}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=KV_GRPC_OPTIONS)
    sink_call = channel.stream_unary(f"/{_SINK_SERVICE}/{_SINK_METHOD}")
    sockets = _SocketPair()

    rows, per_size, bit_exact = [], [], True
    try:
        for mib, n in sizes:
            # Non-contiguous, shuffled ids on both sides, as a real block table would have.
            src_ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()
            dst_ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()
            hashes = list(range(1, n + 1))
            rid = f"bench-{mib}"
            reservations[rid] = Reservation(0, tuple(dst_ids), tuple(hashes))
            nbytes = n * block_bytes_all_layers
            units = payload_units(src_pool, src_ids, range(NUM_LAYERS))
            payload = b"".join(units)  # the bytes every path moves
            out = bytearray(len(payload))
            header = build_header(
                request_id=rid, fingerprint=FINGERPRINT, layout=PoolLayout.of(src_pool), dest_block_ids=dst_ids,
                block_hashes=hashes, num_tokens=n * BLOCK_SIZE, layers=range(NUM_LAYERS), checksum_algorithm=algorithm,
            )
            serialized = list(iter_wire_messages(header, units))

            def grpc_once() -> None:
                push_blocks(
                    channel, src_pool, request_id=rid, fingerprint=FINGERPRINT, src_block_ids=src_ids,
                    block_hashes=hashes, num_tokens=n * BLOCK_SIZE, dest_block_ids=dst_ids,
                    checksum_algorithm=algorithm,
                )

            grpc_t, sock_t, bytes_t = _interleaved_times(
                [grpc_once, lambda: sockets.transfer(payload, out), lambda: sink_call(iter(serialized))],
                args.seconds_per_size,
            )
            exact = torch.equal(dst_pool[:, dst_ids], src_pool[:, src_ids])
            bit_exact = bit_exact and exact and out == payload
            g, s, f = (nbytes / statistics.median(t) / GB for t in (grpc_t, sock_t, bytes_t))
            per_size.append(
                {"mib": mib, "blocks": n, "bytes": nbytes, "gbps": round(g, 3), "socket_gbps": round(s, 3),
                 "grpc_bytes_gbps": round(f, 3), "ratio": round(g / s, 3), "reps": len(grpc_t), "bit_exact": exact}
            )
            rows.append([nbytes / (1 << 20), n, g, f, s, g / s, exact])
            report.progress(f"{mib} MiB: grpc {g:.2f} GB/s, grpc bytes-only {f:.2f} GB/s, socket {s:.2f} GB/s")
    finally:
        sockets.close()
        channel.close()
        server.stop(grace=None)

    report.table(["MiB", "blocks", "grpc GB/s", "grpc bytes GB/s", "socket GB/s", "ratio", "bit_exact"], rows)
    total = sum(p["bytes"] for p in per_size)

    def weighted(key: str) -> float:
        return total / sum(p["bytes"] / (p[key] * GB) for p in per_size) / GB

    gbps, socket_gbps, bytes_gbps = weighted("gbps"), weighted("socket_gbps"), weighted("grpc_bytes_gbps")
    if args.plot:
        _plot(per_size, args.plot)
        report.progress(f"plot written to {args.plot}")
    components = _components(report)
    return {
        "unit": "gigabytes per second (1e9 bytes/s)",
        "gbps": round(gbps, 3),
        "socket_gbps": round(socket_gbps, 3),
        "ratio": round(gbps / socket_gbps, 3),
        "grpc_bytes_gbps": round(bytes_gbps, 3),
        "checksum": args.checksum,
        "bit_exact": bit_exact,
        "per_size": per_size,
        "components": components,
    }


def _components(report, mib: int = 64, reps: int = 5) -> dict:
    """Checksum throughput per algorithm, and a fresh vs a reused receive buffer, on ``mib`` MiB
    (best of ``reps``)."""
    payload = torch.randn(mib << 18).numpy().tobytes()  # [mib MiB] of float32 noise
    view = memoryview(payload)

    def best(fn) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    gibps = {}
    for algorithm in checksums.supported():
        name = kv_pb2.ChecksumAlgorithm.Name(algorithm).removeprefix("CHECKSUM_ALGORITHM_").lower()

        def digest(algorithm=algorithm) -> None:
            c = checksums.new_checksum(algorithm)
            c.update(view)
            c.value()

        gibps[name] = round(mib / 1024 / best(digest), 2)
    warm = bytearray(len(payload))

    def fresh() -> None:
        bytearray(len(payload))[:] = view

    def reused() -> None:
        warm[:] = view

    out = {"mib": mib, "checksum_gibps": gibps, "fresh_buffer_ms": round(best(fresh) * 1e3, 1),
           "reused_buffer_ms": round(best(reused) * 1e3, 1)}
    report.progress(f"components on {mib} MiB: checksum GiB/s {gibps}, receive buffer fresh "
                    f"{out['fresh_buffer_ms']} ms vs reused {out['reused_buffer_ms']} ms")
    return out


def _plot(per_size: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = [p["bytes"] / (1 << 20) for p in per_size]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(mib, [p["gbps"] for p in per_size], marker="o", label="gRPC pool -> pool (kv_transfer)")
    ax.plot(mib, [p["grpc_bytes_gbps"] for p in per_size], marker="^", ls="--", label="gRPC bytes only (no kv_transfer work)")
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
