"""`pdserve bench load`: a soak test. Many concurrent streams against a local cluster for a
while, then what it left behind.

    pdserve bench load --json                       # 256 streams for 60 s (the defaults)
    pdserve bench load --streams 16 --seconds 5     # smoke run
    pdserve bench load --http --overload 10 --json  # the HTTP front at 10x its admitted requests,
                                                    # maximum-size bodies (bench/load_http.py)

The cluster is `pdserve up`'s parts (Redis, a local Ray, node actors, the router in this
process) on loopback, serving a tiny random-weight Llama with the SmolLM2 tokenizer (the point
is the serving machinery, not the model). ``--streams`` client streams run closed-loop: each
sends its next request when the last ends, so the offered load is ``--streams`` in flight for
``--seconds``; the router's and nodes' bounds decide how many of them are served at once and
answer the rest RESOURCE_EXHAUSTED (the gRPC form of HTTP 429, counted as ``rejected_429``; a
rejected stream waits its retry hint, then tries again).

    requests               requests completed
    errors                 requests that failed otherwise (any other error is a bug)
    rejected_429           RESOURCE_EXHAUSTED answers (overload, with a retry hint)
    ttft_p99_s             99th percentile time to first token of the completed requests
    rss_growth_mb_per_min  slope of the summed RSS of the cluster's processes (this process,
                           which runs the router and the load, plus every node actor) over the
                           measured run, after a warm-up run; flat memory is about 0
    rss_growth_mb_per_min_second_half
                           the same over the run's second half: growth that settles falls
                           there, a leak proportional to requests does not
    leaked_blocks          KV blocks not back in the nodes' free pools once the cluster is idle
    leaked_fds             open file descriptors of the same processes, idle after the measured
                           run minus idle before it (no client connected either time). Pools
                           grow with peak concurrency, not with requests (the KV data plane
                           keeps idle connections per peer: kv_transfer/tcp_transport.py), so a
                           few may show after a short run; a leak keeps growing with the run

Only loopback addresses are used; nothing leaves the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from pathlib import Path

from bench import load_http
from bench.tiny_model import tiny_model_with_tokenizer
from router.quantiles import nearest_rank


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=256, help="concurrent client streams (closed loop)")
    p.add_argument("--seconds", type=float, default=60.0, help="how long the load runs")
    p.add_argument("--warmup-s", type=float, default=10.0,
                   help="load before the measured run (then the cluster settles and the fd baseline is taken)")
    p.add_argument("--prefill-nodes", type=int, default=1)
    p.add_argument("--decode-nodes", type=int, default=1)
    p.add_argument("--prompt-tokens", default="16,200", help="MIN,MAX prompt length (uniform)")
    p.add_argument("--max-tokens", default="8,64", help="MIN,MAX output tokens (uniform)")
    p.add_argument("--settle-s", type=float, default=30.0,
                   help="after the load, how long to wait for the nodes to go idle before counting leaks")
    p.add_argument("--seed", type=int, default=0)
    load_http.add_arguments(p)


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise SystemExit(f"expected MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


class Resources:
    """RSS and open fds of a set of processes, summed."""

    def __init__(self, pids: list[int]) -> None:
        import psutil

        self.procs = [psutil.Process(p) for p in pids]

    def rss_mb(self) -> float:
        return sum(p.memory_info().rss for p in self.procs if p.is_running()) / 2**20

    def fds(self) -> int:
        return sum(p.num_fds() for p in self.procs if p.is_running())


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) samples, per minute."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    return 60.0 * sum((t - mt) * (v - mv) for t, v in samples) / var


class LoadStats:
    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.rejected = 0
        self.ttft: list[float] = []
        self.error_samples: list[str] = []


async def _one_stream(client, rng: random.Random, args, stop_at: float, stats: LoadStats) -> None:
    import pdserve

    plo, phi = _range(args.prompt_tokens)
    mlo, mhi = _range(args.max_tokens)
    while time.monotonic() < stop_at:
        ids = [rng.randrange(3, 49000) for _ in range(rng.randint(plo, phi))]
        t0 = time.monotonic()
        first = None
        try:
            stream = client.generate(token_ids=ids, max_tokens=rng.randint(mlo, mhi), temperature=0.0,
                                     ignore_eos=True, timeout=300)
            async for chunk in stream:
                if first is None and chunk.token_ids:
                    first = time.monotonic() - t0
            done = stream.completion
            if done is None or done.finish_reason == "error":
                raise RuntimeError("the stream ended without a clean completion")
            stats.requests += 1
            stats.ttft.append(first if first is not None else time.monotonic() - t0)
        except pdserve.ResourceExhaustedError as e:
            stats.rejected += 1
            await asyncio.sleep(e.retry_after_s or 0.2)
        except Exception as e:  # noqa: BLE001 - counted and shown: any other failure is a bug
            stats.errors += 1
            if len(stats.error_samples) < 5:
                stats.error_samples.append(f"{type(e).__name__}: {e}"[:300])


async def _load(address: str, args, seconds: float, res: Resources, report) -> tuple[LoadStats, list]:
    """``args.streams`` closed-loop streams for ``seconds``; RSS sampled every second."""
    import pdserve

    stats = LoadStats()
    t0 = time.monotonic()
    stop_at = t0 + seconds
    rss: list[tuple[float, float]] = []

    async def sampler() -> None:
        while time.monotonic() < stop_at:
            rss.append((time.monotonic() - t0, res.rss_mb()))
            await asyncio.sleep(1.0)

    # A few channels, as a few client processes would have: one HTTP/2 connection per client.
    clients = [pdserve.AsyncClient(address, retries=0) for _ in range(max(1, min(8, args.streams // 32)))]
    rng = random.Random(args.seed)
    try:
        tasks = [asyncio.ensure_future(_one_stream(clients[i % len(clients)], random.Random(rng.random()), args,
                                                   stop_at, stats)) for i in range(args.streams)]
        tasks.append(asyncio.ensure_future(sampler()))
        await asyncio.gather(*tasks)
    finally:
        for c in clients:
            await c.close()
    return stats, rss


def _node_stats(cluster) -> dict[str, dict]:
    import ray

    return {nid: ray.get(a.stats.remote(), timeout=30) for nid, a in cluster.actors.items()}


def _idle(stats: dict[str, dict]) -> bool:
    return all(s["free_blocks"] == s["num_blocks"] and not s["running"] and not s["waiting"]
               and not s.get("reservations") and not s.get("inflight_calls") for s in stats.values())


def _settle(cluster, timeout_s: float) -> dict[str, dict]:
    """Wait (up to ``timeout_s``) for every node to be idle; returns their last stats."""
    deadline = time.monotonic() + timeout_s
    while not _idle(stats := _node_stats(cluster)) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(1.0)  # closed channels and finished threads give their fds back
    return stats


def run(args: argparse.Namespace, report) -> dict:
    from deploy.launcher import ClusterConfig, LocalCluster
    from engine.config import CacheConfig, EngineConfig

    try:
        import psutil  # noqa: F401 - Resources needs it
    except ImportError:
        raise SystemExit("pdserve bench load needs psutil (pip install psutil)") from None
    if args.seconds <= 0:
        raise SystemExit("--seconds must be > 0")
    if args.http:
        if args.overload <= 0 or args.max_inflight < 1:
            raise SystemExit("--overload must be > 0 and --max-inflight >= 1")
        return load_http.run(args, report)
    if args.streams < 1:
        raise SystemExit("--streams must be >= 1")
    with tempfile.TemporaryDirectory(prefix="pdserve-load-") as tmp:
        report.progress("building the tiny model")
        model = tiny_model_with_tokenizer(Path(tmp))
        engine = EngineConfig(model=str(model), dtype="float32", cache=CacheConfig(block_size=16, num_blocks=2048))
        cfg = ClusterConfig(engine=engine, prefill_nodes=args.prefill_nodes, decode_nodes=args.decode_nodes,
                            host="127.0.0.1", grpc_port=0, http_port=None, dashboard_port=0, short_prompt_tokens=64)
        cluster = LocalCluster(cfg, report.progress).start()
        try:
            stats0 = _node_stats(cluster)
            res = Resources([os.getpid(), *(st["pid"] for st in stats0.values())])
            report.progress(f"{args.streams} streams: {args.warmup_s:.0f} s warm-up")
            asyncio.run(_load(cluster.address, args, args.warmup_s, res, report))
            # Baselines with the cluster idle and no client connected, as at the end.
            _settle(cluster, args.settle_s)
            fds_before = res.fds()
            report.progress(f"{args.streams} streams for {args.seconds:.0f} s")
            load, rss = asyncio.run(_load(cluster.address, args, args.seconds, res, report))
            report.progress(f"load done: {load.requests} requests, {load.rejected} rejected, {load.errors} errors; "
                            "waiting for the nodes to go idle")
            stats = _settle(cluster, args.settle_s)
            leaked_blocks = sum(st["num_blocks"] - st["free_blocks"] for st in stats.values())
            leaked_fds = max(0, res.fds() - fds_before)
        finally:
            cluster.stop()
    result = {
        "requests": load.requests, "concurrency": args.streams, "seconds": args.seconds, "errors": load.errors,
        "rejected_429": load.rejected, "ttft_p99_s": nearest_rank(load.ttft, 0.99),
        "rss_growth_mb_per_min": round(slope_per_min(rss), 3),
        # The second half alone: growth that settles (allocator arenas, buffers reaching their
        # working size) falls here; a leak proportional to requests keeps the whole run's slope.
        "rss_growth_mb_per_min_second_half": round(slope_per_min(rss[len(rss) // 2:]), 3),
        "leaked_blocks": leaked_blocks,
        "leaked_fds": leaked_fds,
    }
    if rss:
        report.progress(f"RSS of the cluster's processes: {rss[0][1]:.0f} MB after the warm-up, "
                        f"{rss[-1][1]:.0f} MB at the end ({len(rss)} samples)")
    report.table(["figure", "value"], [[k, v] for k, v in result.items()])
    if load.error_samples:
        report.progress("errors, first ones: " + " | ".join(load.error_samples))
    return {**result, "error_samples": load.error_samples}
