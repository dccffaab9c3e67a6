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
  memcpy: ceiling of shared memory: a copy of the same bytes, timed three ways (one thread,
          os.cpu_count() threads, two processes half each: bench/transfer_memcpy.py); the
          fastest per size is the ceiling (``memcpy_one_thread_gbps``, ``memcpy_threads_gbps``,
          ``memcpy_two_process_gbps``; weighted in ``memcpy_ceiling``).
  grpc_bytes: diagnostic. The serialized KVBlockMessages into a gRPC handler that only reads
          them: what grpcio itself allows (grpc / grpc_bytes is kv_transfer's own overhead).

Throughput is in gigabytes per second (1e9 bytes/s), from each size's median time; headline
figures weigh sizes by bytes (all bytes over the sum of the per-size median times). Each
transport's ``ratio`` is to its ceiling measured in the same run; ``ratio_chat_sized`` is the
same over the sizes of a chat turn's KV only (CHAT_SIZED_MIB, named in ``chat_sized_mib``).

``bit_exact``: per transport (``transports[t]["bit_exact"]``, ``bit_exact_by_transport``) and
all of them. Every transport writes the same blocks, so each is checked in a pass of its own
after the timing, at every size and fixed-cost case: the receiver fills the destination blocks
with a sentinel, the transport pushes once, the digest must equal the source's
(bench/transfer_rig.py, ``Rig.verify``).

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
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.plotting import figure
from bench.transfer_memcpy import WAYS as MEMCPY_WAYS
from bench.transfer_memcpy import MemcpyCeilings
from bench.transfer_receiver import RAW_MODES
from bench.transfer_rig import BLOCK_BYTES, TRANSPORTS, Rig, exact_by_transport
from kv_transfer import checksum as checksums
from kv_transfer.dist_transport import DistKVSender
from protos.pdserve.v1 import kv_pb2

GB = 1e9
FIXED_BLOCKS = (1, 4, 16)
CEILING = {"grpc": "socket", "tcp": "socket", "shm": "memcpy", "dist": "socket"}
# Sizes of a chat turn's KV (a few thousand tokens of SmolLM2-135M: 2-16 MiB). The headline is
# weighted by bytes, so the 32 and 64 MiB points dominate it; the ratio over these sizes is
# reported beside it, since most transfers a chat server makes are this size.
CHAT_SIZED_MIB = (2, 16)
# Every path, timed interleaved per size; "socket" and "memcpy" are the best of their ways.
PATHS = (*TRANSPORTS, *(f"socket_{mode}" for mode in RAW_MODES), *(f"memcpy_{way}" for way in MEMCPY_WAYS),
         "grpc_bytes")
SHOWN = (*TRANSPORTS, "socket", *(f"socket_{mode}" for mode in RAW_MODES), "memcpy",
         *(f"memcpy_{way}" for way in MEMCPY_WAYS), "grpc_bytes")  # the table's columns


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
    sizes = [(mib, _blocks_for(mib, BLOCK_BYTES)) for mib in args.sizes_mib]
    rig = Rig(2 * max(max(n for _, n in sizes), max(FIXED_BLOCKS)) + 8, args.checksum)
    memcpy = MemcpyCeilings(max(n for _, n in sizes) * BLOCK_BYTES)
    report.progress(f"pools {rig.shape} float32, {BLOCK_BYTES} bytes per block (all layers), "
                    f"checksum {args.checksum}; receiver in its own process; memcpy ceiling: best of 1 "
                    f"thread, {memcpy.threads} threads, 2 processes")
    ray = None
    try:
        if args.ray:
            from bench.transfer_ray import RayPath

            ray = RayPath(rig.src_pool)
            report.progress("Ray started: timing its object store beside shm")
        per_size, checks = _sweep(rig, memcpy, ray, sizes, args.seconds_per_size, report)
        fixed_ms, latency_ms, fixed_checks = _fixed_costs(rig, args.quick, report)
    finally:
        memcpy.close()
        rig.close()
        if ray is not None:
            ray.shutdown()
    exact = exact_by_transport(checks + fixed_checks)
    transports, memcpy_ceiling = _summary(per_size, exact, memcpy.threads, ray is not None)
    if ray is not None:  # a comparison, not a transport of kv_transfer: no fixed cost measured
        fixed_ms["ray_object_store"] = None
    transports["dist"]["setup_ms"] = dist_setup_ms(rig.dist)
    report.table(["transport", "GB/s", "ceiling", "ceiling GB/s", "ratio",
                  f"ratio {CHAT_SIZED_MIB[0]}-{CHAT_SIZED_MIB[1]} MiB", "fixed ms", "bit_exact"],
                 [[t, v["gbps"], v["ceiling"], v["ceiling_gbps"], v["ratio"], v["ratio_chat_sized"], fixed_ms[t],
                   v["bit_exact"]] for t, v in transports.items()])
    if args.plot:
        _plot(per_size, args.plot)
        report.progress(f"plot written to {args.plot}")
    components = _components(report, mib=8 if args.quick else 64)
    streaming = _streaming(args, report) if args.streaming else {}
    grpc_t = transports["grpc"]
    return {
        "unit": "gigabytes per second (1e9 bytes/s)",
        "transports": transports,
        "bit_exact": all(exact.values()),
        "bit_exact_by_transport": exact,
        "memcpy_ceiling": memcpy_ceiling,
        "chat_sized_mib": [p["mib"] for p in per_size if _chat_sized(p)],
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
        "grpc_bytes_gbps": round(_weighted(per_size, "grpc_bytes"), 3),
        "checksum": args.checksum,
        "per_size": per_size,
        "components": components,
    }


def _sweep(rig: Rig, memcpy: MemcpyCeilings, ray, sizes: list[tuple[int, int]], budget_s: float,
           report) -> tuple[list[dict], list[dict[str, bool]]]:
    """Per size: every path timed interleaved, then each transport's bit-exactness checked on
    its own (``Rig.verify``). Returns the per-size rows and the checks."""
    paths = (*PATHS, "ray") if ray is not None else PATHS
    per_size, checks, rows = [], [], []
    for mib, n in sizes:
        c = rig.case(n)
        c.update(memcpy.fns(c["payload"]))
        if ray is not None:
            c["ray"] = ray.transfer_fn(c)
        times = dict(zip(paths, _interleaved_times([c[p] for p in paths], budget_s)))
        ok = rig.verify(c)
        if ray is not None:
            ok["ray_object_store"] = ray.verify(c)
        checks.append(ok)
        gbps = {p: c["bytes"] / statistics.median(times[p]) / GB for p in paths}
        gbps["socket"] = max(gbps[f"socket_{mode}"] for mode in RAW_MODES)  # the ceilings at their best
        gbps["memcpy"] = max(gbps[f"memcpy_{way}"] for way in MEMCPY_WAYS)
        per_size.append({"mib": mib, "blocks": n, "bytes": c["bytes"], "reps": len(times["grpc"]),
                         "bit_exact": all(ok.values()), "bit_exact_by_transport": ok,
                         **{f"{p}_gbps": round(g, 3) for p, g in gbps.items()}})
        shown = (*SHOWN, "ray") if ray is not None else SHOWN
        rows.append([c["bytes"] / (1 << 20), n, *(gbps[p] for p in shown), _failed(ok)])
        report.progress(f"{mib} MiB: " + ", ".join(f"{p} {gbps[p]:.2f}" for p in shown) + " GB/s")
    report.table(["MiB", "blocks", *(f"{p} GB/s" for p in shown), "bit_exact"], rows)
    return per_size, checks


def _failed(ok: dict[str, bool]) -> str:
    """A table cell: "yes", or the paths whose check failed."""
    bad = [t for t, v in ok.items() if not v]
    return "no: " + ", ".join(bad) if bad else "yes"


def _chat_sized(size: dict) -> bool:
    return CHAT_SIZED_MIB[0] <= size["mib"] <= CHAT_SIZED_MIB[1]


def _weighted(per_size: list[dict], path: str) -> float:
    """``path``'s throughput over ``per_size`` weighted by bytes: all bytes over the sum of the
    per-size median times (GB/s)."""
    total = sum(p["bytes"] for p in per_size)
    return total / sum(p["bytes"] / (p[f"{path}_gbps"] * GB) for p in per_size) / GB


def _ratio(per_size: list[dict], path: str, ceiling: str) -> float | None:
    return round(_weighted(per_size, path) / _weighted(per_size, ceiling), 3) if per_size else None


def _summary(per_size: list[dict], exact: dict[str, bool], threads: int, ray: bool) -> tuple[dict, dict]:
    """Per transport: throughput, ceiling, ratio (all sizes and chat-sized ones), bit_exact;
    and the memcpy ceiling's ways."""
    chat = [p for p in per_size if _chat_sized(p)]
    transports = {}
    for t in TRANSPORTS:
        g, ceiling = _weighted(per_size, t), _weighted(per_size, CEILING[t])
        transports[t] = {"gbps": round(g, 3), "ceiling": CEILING[t], "ceiling_gbps": round(ceiling, 3),
                         "ratio": round(g / ceiling, 3), "ratio_chat_sized": _ratio(chat, t, CEILING[t]),
                         "bit_exact": exact[t]}
    if ray:
        g, ceiling = _weighted(per_size, "ray"), _weighted(per_size, "memcpy")
        transports["ray_object_store"] = {"gbps": round(g, 3), "ceiling": "memcpy", "ceiling_gbps": round(ceiling, 3),
                                          "ratio": round(g / ceiling, 3), "ratio_chat_sized": _ratio(chat, "ray", "memcpy"),
                                          "bit_exact": exact["ray_object_store"]}
    ways = {f"{way}_gbps": round(_weighted(per_size, f"memcpy_{way}"), 3) for way in MEMCPY_WAYS}
    memcpy_ceiling = {**ways, "threads": threads, "best_gbps": transports["shm"]["ceiling_gbps"],
                      "fastest": max(MEMCPY_WAYS, key=lambda way: ways[f"{way}_gbps"])}
    return transports, memcpy_ceiling


def dist_setup_ms(sender: DistKVSender) -> float | None:
    """The mean set-up time of the dist sender's process groups (attach, rendezvous, join),
    in ms; each is paid once per kept data connection, not per transfer."""
    if not sender.groups_made:
        return None
    return round(1000 * sender.setup_s_total / sender.groups_made, 2)


def _fixed_costs(rig: Rig, quick: bool, report) -> tuple[dict, dict, list[dict[str, bool]]]:
    """Median time of 1, 4 and 16-block transfers per transport, and the intercept of the
    least-squares line through them (the cost of a transfer before its bytes); and each
    size's bit-exactness checks (``Rig.verify``)."""
    latency: dict[str, dict[str, float]] = {}
    sizes: list[int] = []
    medians: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    checks = []
    for n in FIXED_BLOCKS:
        c = rig.case(n)
        times = dict(zip(TRANSPORTS, _interleaved_times([c[t] for t in TRANSPORTS], 0.2 if quick else 2.0,
                                                         min_reps=5 if quick else 20, max_reps=200)))
        checks.append(rig.verify(c))
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
    return fixed, latency, checks


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
