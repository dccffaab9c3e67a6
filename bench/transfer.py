"""`pdserve bench transfer`: KV blocks pool -> pool through each transport, against its ceiling.

The receiver is another process (bench/transfer_receiver.py), as a decode node is: a
decode node's data plane without its engine. Every path moves the same blocks of a source pool
into reserved blocks of the receiver's pool on 127.0.0.1, the repeats of all paths interleaved
so they see the same machine load:

  grpc:   kv_transfer.push_blocks -> KVReceiver (validation, buffering, XXH3-64, one scatter).
  tcp:    TcpKVSender -> TcpKVServer: the raw data stream beside gRPC (frames + raw bytes on a
          kept connection; the kernel gathers the blocks, the receiver checks each chunk's
          checksum before scattering it).
  shm:    ShmKVSender -> the same server: the sender gathers chunks into a shared-memory
          buffer the receiver has mapped; only the frames cross the socket.
  dist:   DistKVSender -> the same server: the frames on the data connection, the chunks' bytes
          over a two-rank gloo process group made once per kept connection (its ``setup_ms``:
          the mean set-up of the groups the run made, paid once per connection, not per transfer).
  socket: ceiling of the network transports: the same bytes, length-prefixed, sendall ->
          recv_into a reused buffer, one ack byte back; no gather, checksum or scatter. Timed
          three ways: the kernel's default socket options, the data port's (4 MiB buffers),
          and a cache-warm 1 MiB receive buffer; the fastest per size is the ceiling
          (``socket_default_gbps``, ``socket_tuned_gbps``, ``socket_warm_gbps``).
  memcpy: ceiling of shared memory: one copy of the same bytes into a reused buffer, in the
          sending process.
  grpc_bytes: diagnostic. The serialized KVBlockMessages into a gRPC handler that only reads
          them: what grpcio itself allows (grpc / grpc_bytes is kv_transfer's own overhead).

Throughput is in gigabytes per second (1e9 bytes/s), from each size's median time; headline
figures weigh sizes by bytes (all bytes over the sum of the per-size median times). Each
transport's ``ratio`` is to its ceiling measured in the same run.

``fixed_ms``: the cost of a transfer before its bytes, per transport: the intercept of a
least-squares line through the median times of 1, 4 and 16-block transfers (``latency_ms``).

``components`` times two choices of the receiver on 64 MiB: each checksum algorithm's
throughput (GiB/s), and filling a fresh receive buffer vs a reused one.

``overlap``, ``ttft_streaming_s``, ``ttft_after_prefill_s`` (and ``streaming``): layer-wise KV
streaming on a real prefill and decode node, on a 2,048-token prompt of SmolLM2-135M, with and
without streaming in one run (bench/transfer_streaming.py, where the definitions are):
``overlap`` = 1 - (time from the first token to the last KV push landing, streamed) / (push
time after the prefill, not streamed), the fraction of the transfer hidden behind compute.
``--streaming-only`` runs just that part; ``--no-streaming`` skips it.

The KV has SmolLM2-135M's shape: 30 layers, 3 KV heads, head_dim 64, block 16, float32, so one
block of 16 tokens over all layers is 737,280 bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import numpy as np
import torch
import xxhash

from bench.plotting import figure
from bench.transfer_receiver import RAW_LEN, RAW_MODES, SINK_METHOD, SINK_SERVICE, set_raw_options
from kv_transfer import checksum as checksums
from kv_transfer.dist_transport import DistKVSender, dist_endpoint
from kv_transfer.grpc_transport import KV_GRPC_OPTIONS, push_blocks
from kv_transfer.layout import PoolLayout
from kv_transfer.shm_transport import ShmKVSender, shm_endpoint
from kv_transfer.tcp_transport import TcpKVSender
from kv_transfer.validate import new_token
from kv_transfer.wire import build_header, iter_wire_messages, payload_units
from protos.pdserve.v1 import kv_pb2

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
FINGERPRINT = "bench"  # the receiver's
GB = 1e9
FIXED_BLOCKS = (1, 4, 16)
TRANSPORTS = ("grpc", "tcp", "shm", "dist")
CEILING = {"grpc": "socket", "tcp": "socket", "shm": "memcpy", "dist": "socket"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes-mib", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="request KV sizes (MiB)"
    )
    parser.add_argument("--seconds-per-size", type=float, default=5.0, help="time budget per size (all paths)")
    parser.add_argument(
        "--checksum", choices=["crc32", "xxh3_64"], default="xxh3_64",
        help="payload checksum (the default is what nodes use)",
    )
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: sizes 1 and 4 MiB, 0.3 s per size, few repeats, components on 8 MiB")
    parser.add_argument("--ray", action="store_true",
                        help="also time Ray's object store (numpy views) as a same-host path, beside shm "
                             "(starts a local Ray: ~5 s, ~0.7 GB)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw throughput vs size for the paths")
    parser.add_argument("--no-streaming", dest="streaming", action="store_false",
                        help="skip the layer-wise streaming comparison (overlap and the two TTFTs stay null)")
    parser.add_argument("--streaming-only", action="store_true",
                        help="only the layer-wise streaming comparison (no transport sweep)")
    parser.add_argument("--streaming-model", default=None,
                        help="model of the streaming comparison (default smollm2-135m; --quick: tiny-llama)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="prompt length of the streaming comparison (default 2048; --quick: 384)")
    parser.add_argument("--streaming-repeats", type=int, default=None,
                        help="requests per way in the streaming comparison (median; default 5, --quick: 2)")


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


class _Receiver:
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


def _streaming(args: argparse.Namespace, report) -> dict:
    from bench import transfer_streaming

    preset = dict(transfer_streaming.QUICK if args.quick else transfer_streaming.FULL)
    for key, value in (("model", args.streaming_model), ("prompt_tokens", args.prompt_tokens),
                       ("repeats", args.streaming_repeats)):
        if value is not None:
            preset[key] = value
    report.progress(f"layer-wise streaming: {preset['prompt_tokens']}-token prompts of {preset['model']}, "
                    f"streaming on vs off, {preset['repeats']} repeats each")
    return transfer_streaming.measure(report, quick=args.quick, **preset)


def run(args: argparse.Namespace, report) -> dict:
    if args.streaming_only:
        return {"unit": "seconds", **_streaming(args, report)}
    if args.quick:
        args.sizes_mib, args.seconds_per_size = [1, 4], 0.3
    block_bytes_all_layers = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
    sizes = [(mib, _blocks_for(mib, block_bytes_all_layers)) for mib in args.sizes_mib]
    num_blocks = 2 * max(max(n for _, n in sizes), max(FIXED_BLOCKS)) + 8
    gen = torch.Generator().manual_seed(0)
    shape = (NUM_LAYERS, num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    src_pool = torch.randn(shape, generator=gen)  # [layers, blocks, 2, block, heads, dim]
    algorithm = kv_pb2.ChecksumAlgorithm.Value(f"CHECKSUM_ALGORITHM_{args.checksum.upper()}")
    report.progress(f"pools {tuple(shape)} float32, {block_bytes_all_layers} bytes per block (all layers), "
                    f"checksum {args.checksum}; receiver in its own process")
    receiver, tcp, shm, dist = _Receiver(shape), TcpKVSender(), ShmKVSender(), DistKVSender()
    bit_exact, count = True, iter(range(1 << 30))

    def case(n: int) -> dict:
        """A reservation of n blocks in the receiver and one callable per path."""
        src_ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()  # shuffled, as a block table is
        dst_ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()
        hashes = list(range(1, n + 1))
        rid = f"bench-{n}-{next(count)}"
        token = new_token()
        receiver.ask(reserve=rid, first=0, dest=dst_ids, hashes=hashes, token=token.hex())
        blocks = dict(request_id=rid, fingerprint=FINGERPRINT, src_block_ids=src_ids, block_hashes=hashes,
                      num_tokens=n * BLOCK_SIZE, dest_block_ids=dst_ids, token=token, checksum_algorithm=algorithm)
        payload = b"".join(payload_units(src_pool, src_ids, range(NUM_LAYERS)))
        staging = np.empty(len(payload), dtype=np.uint8)
        header = build_header(request_id=rid, fingerprint=FINGERPRINT, layout=PoolLayout.of(src_pool),
                              dest_block_ids=dst_ids, block_hashes=hashes, num_tokens=n * BLOCK_SIZE,
                              layers=range(NUM_LAYERS), checksum_algorithm=algorithm, token=token)
        serialized = list(iter_wire_messages(header, payload_units(src_pool, src_ids, range(NUM_LAYERS))))
        return {
            "src_ids": src_ids, "dst_ids": dst_ids, "bytes": len(payload),
            "grpc": lambda: push_blocks(receiver.channel, src_pool, **blocks),
            "tcp": lambda: tcp.push(receiver.tcp_endpoint, src_pool, **blocks),
            "shm": lambda: shm.push(receiver.shm_endpoint, src_pool, **blocks),
            "dist": lambda: dist.push(receiver.dist_endpoint, src_pool, **blocks),
            **{f"socket_{mode}": (lambda mode=mode: receiver.raw_transfer(payload, mode)) for mode in RAW_MODES},
            "memcpy": lambda: np.copyto(staging, np.frombuffer(payload, dtype=np.uint8)),
            "grpc_bytes": lambda: receiver.sink(iter(serialized)),
        }

    def exact(c: dict) -> bool:
        want = xxhash.xxh3_64(src_pool[:, c["src_ids"]].contiguous().numpy().tobytes()).hexdigest()
        return receiver.ask(digest=c["dst_ids"])["xxh3"] == want

    paths = (*TRANSPORTS, *(f"socket_{mode}" for mode in RAW_MODES), "memcpy", "grpc_bytes")
    ray = None
    if args.ray:
        from bench import transfer_ray

        ray, ray_actor = transfer_ray.start(shape)
        paths = (*paths, "ray")
        unit = src_pool[0, 0].numel() * 4
        src_rows = src_pool.view(-1).view(torch.uint8).view(-1, unit).numpy()
        layer_rows = np.arange(NUM_LAYERS)[:, None] * num_blocks  # [layers, 1]
        report.progress("Ray started: timing its object store beside shm")
    shown = (*paths[:4], "socket", *paths[4:])  # the table's columns: the ceiling, then how it was taken
    rows, per_size = [], []
    try:
        for mib, n in sizes:
            c = case(n)
            if ray is not None:  # the same blocks, layer-major like the wire, into the same rows
                c["ray"] = transfer_ray.transfer_fn(
                    ray, ray_actor, src_rows, (layer_rows + np.asarray(c["src_ids"])).ravel(),
                    (layer_rows + np.asarray(c["dst_ids"])).ravel())
            times = dict(zip(paths, _interleaved_times([c[p] for p in paths], args.seconds_per_size)))
            ok = exact(c)
            if ray is not None:
                src_idx = (layer_rows + np.asarray(c["src_ids"])).ravel()
                want = xxhash.xxh3_64(np.ascontiguousarray(src_rows[src_idx])).hexdigest()
                dst_idx = (layer_rows + np.asarray(c["dst_ids"])).ravel()
                ok = ok and ray.get(ray_actor.digest.remote(dst_idx)) == want
            bit_exact = bit_exact and ok
            gbps = {p: c["bytes"] / statistics.median(times[p]) / GB for p in paths}
            gbps["socket"] = max(gbps[f"socket_{mode}"] for mode in RAW_MODES)  # the ceiling at its best
            per_size.append({"mib": mib, "blocks": n, "bytes": c["bytes"], "reps": len(times["grpc"]),
                             "bit_exact": ok, **{f"{p}_gbps": round(g, 3) for p, g in gbps.items()}})
            rows.append([c["bytes"] / (1 << 20), n, *(gbps[p] for p in shown), ok])
            report.progress(f"{mib} MiB: " + ", ".join(f"{p} {gbps[p]:.2f}" for p in shown) + " GB/s")
        fixed_ms, latency_ms = _fixed_costs(case, exact, args.quick, report)
        bit_exact = bit_exact and fixed_ms.pop("bit_exact")
    finally:
        for sender in (tcp, shm, dist):
            sender.close()
        receiver.close()
        if ray is not None:
            ray.shutdown()

    report.table(["MiB", "blocks", *(f"{p} GB/s" for p in shown), "bit_exact"], rows)
    total = sum(p["bytes"] for p in per_size)

    def weighted(path: str) -> float:
        return total / sum(p["bytes"] / (p[f"{path}_gbps"] * GB) for p in per_size) / GB

    transports = {}
    for t in TRANSPORTS:
        g, ceiling = weighted(t), weighted(CEILING[t])
        transports[t] = {"gbps": round(g, 3), "ceiling": CEILING[t], "ceiling_gbps": round(ceiling, 3),
                         "ratio": round(g / ceiling, 3)}
    if ray is not None:  # a comparison, not a transport of kv_transfer: no fixed cost measured
        g = weighted("ray")
        transports["ray_object_store"] = {"gbps": round(g, 3), "ceiling": "memcpy",
                                          "ceiling_gbps": transports["shm"]["ceiling_gbps"],
                                          "ratio": round(g / weighted("memcpy"), 3)}
        fixed_ms["ray_object_store"] = None
    transports["dist"]["setup_ms"] = dist_setup_ms(dist)
    report.table(["transport", "GB/s", "ceiling", "ceiling GB/s", "ratio", "fixed ms"],
                 [[t, v["gbps"], v["ceiling"], v["ceiling_gbps"], v["ratio"], fixed_ms[t]] for t, v in transports.items()])
    if args.plot:
        _plot(per_size, args.plot)
        report.progress(f"plot written to {args.plot}")
    components = _components(report, mib=8 if args.quick else 64)
    streaming = _streaming(args, report) if args.streaming else {}
    grpc_t = transports["grpc"]
    return {
        "unit": "gigabytes per second (1e9 bytes/s)",
        "transports": transports,
        "bit_exact": bit_exact,
        "fixed_ms": fixed_ms,
        "latency_ms": latency_ms,
        "overlap": streaming.get("overlap"),
        "ttft_streaming_s": streaming.get("ttft_streaming_s"),
        "ttft_after_prefill_s": streaming.get("ttft_after_prefill_s"),
        "streaming": streaming.get("streaming"),
        # The figures this bench reported before it measured transports side by side.
        "gbps": grpc_t["gbps"],
        "socket_gbps": grpc_t["ceiling_gbps"],
        "ratio": grpc_t["ratio"],
        "grpc_bytes_gbps": round(weighted("grpc_bytes"), 3),
        "checksum": args.checksum,
        "per_size": per_size,
        "components": components,
    }


def dist_setup_ms(sender: DistKVSender) -> float | None:
    """The mean set-up time of the dist sender's process groups (attach, rendezvous, join),
    in ms; each is paid once per kept data connection, not per transfer."""
    if not sender.groups_made:
        return None
    return round(1000 * sender.setup_s_total / sender.groups_made, 2)


def _fixed_costs(case, exact, quick: bool, report) -> tuple[dict, dict]:
    """Median time of 1, 4 and 16-block transfers per transport, and the intercept of the
    least-squares line through them (the cost of a transfer before its bytes)."""
    latency: dict[str, dict[str, float]] = {}
    sizes: list[int] = []
    medians: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    ok = True
    for n in FIXED_BLOCKS:
        c = case(n)
        times = dict(zip(TRANSPORTS, _interleaved_times([c[t] for t in TRANSPORTS], 0.2 if quick else 2.0,
                                                         min_reps=5 if quick else 20, max_reps=200)))
        ok = ok and exact(c)
        sizes.append(c["bytes"])
        latency[str(n)] = {t: round(statistics.median(times[t]) * 1e3, 3) for t in TRANSPORTS}
        for t in TRANSPORTS:
            medians[t].append(statistics.median(times[t]))
        report.progress(f"{n} blocks ({c['bytes']} bytes): " +
                        ", ".join(f"{t} {latency[str(n)][t]:.3f} ms" for t in TRANSPORTS))
    fixed = {}
    for t in TRANSPORTS:
        slope, intercept = np.polyfit(np.asarray(sizes, dtype=float), np.asarray(medians[t]), 1)
        fixed[t] = round(max(0.0, intercept) * 1e3, 3)
    report.progress("fixed cost per transfer (ms): " + ", ".join(f"{t} {fixed[t]}" for t in TRANSPORTS))
    return {**fixed, "bit_exact": ok}, latency


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
    mib = [p["bytes"] / (1 << 20) for p in per_size]
    with figure(path, dpi=120, figsize=(6.5, 4)) as (_, ax):
        for key, label, style in [
            ("grpc", "gRPC PushBlocks (kv_transfer)", dict(marker="o")),
            ("tcp", "raw TCP data stream (kv_transfer)", dict(marker="D")),
            ("shm", "shared memory (kv_transfer)", dict(marker="v")),
            ("socket", "raw TCP socket (bytes only, ceiling)", dict(marker="s", ls=":")),
            ("grpc_bytes", "gRPC bytes only (no kv_transfer work)", dict(marker="^", ls="--")),
        ]:
            ax.plot(mib, [p[f"{key}_gbps"] for p in per_size], label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request KV size (MiB)")
        ax.set_ylabel("GB/s (1e9 bytes/s)")
        ax.set_title("KV transfer on loopback, SmolLM2-135M KV shape")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
