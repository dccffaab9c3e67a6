"""`pdserve bench redis-hang`: what a hung Redis costs a serving cluster, and how fast it recovers.

    pdserve bench redis-hang --json                  # SmolLM2, 4 streams, 10 s / 10 s frozen / 10 s
    pdserve bench redis-hang --freeze-s 30 --streams 8

The cluster is `pdserve up`'s (deploy/launcher.py: a private redis-server, a local Ray, one
prefill and one decode node on the builtin model, the router in this process, default
settings). ``--streams`` SDK clients send greedy requests closed-loop (each sends its next
when the last ends) through three phases:

    before   ``--seconds`` of normal serving: the baseline
    frozen   redis-server stopped with SIGSTOP for ``--freeze-s`` (connections open, nothing
             answers: a hung Redis, not a dead one), resumed with SIGCONT however the run ends
    after    ``--seconds`` from SIGCONT

Prompts share a long prefix, so the index matters before and after. Per phase (a request counts
in the phase it started in): requests, errors, p50 / p99 / max latency. Besides:

    degraded_after_s    SIGSTOP to the router's GET /ready saying ``degraded: true``
    recovered_s         SIGCONT to /ready saying ``degraded: false`` again
    ready_503           /ready answers that were not 200 (a degraded router still serves: 0)
    p50_ratio_frozen    frozen p50 latency / before p50 latency (1.0: a hang costs nothing)
    lookup_failures     prefix lookups that timed out or failed (each cost its request up to
                        --index-lookup-timeout); lookups_skipped: those the breaker skipped

Only loopback addresses are used; nothing leaves the machine.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request

from router.quantiles import nearest_rank

PHASES = ("before", "frozen", "after")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="builtin name or local HF directory")
    p.add_argument("--streams", type=int, default=4, help="concurrent client streams (closed loop)")
    p.add_argument("--seconds", type=float, default=10.0, help="length of the before and after phases")
    p.add_argument("--freeze-s", type=float, default=10.0, help="how long redis-server stays stopped")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=96, help="prompt length; all share the first 64 tokens")


class Log:
    """Every request's (start, seconds, error) and every /ready answer's (time, status, degraded)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[tuple[float, float, str | None]] = []
        self.ready: list[tuple[float, int, bool]] = []


def _client(address: str, prompts: list[list[int]], max_tokens: int, k: int, stop: threading.Event, log: Log):
    import pdserve

    with pdserve.Client(address, timeout=120.0, retries=0) as c:
        i = k
        while not stop.is_set():
            t0 = time.monotonic()
            err = None
            try:
                with c.generate(token_ids=prompts[i % len(prompts)], max_tokens=max_tokens, temperature=0.0,
                                ignore_eos=True) as stream:
                    for _ in stream:
                        pass
                    if stream.completion is None or stream.completion.finish_reason == "error":
                        err = "the stream ended without a clean completion"
            except Exception as e:  # noqa: BLE001 - counted and shown
                err = f"{type(e).__name__}: {e}"[:300]
            with log.lock:
                log.requests.append((t0, time.monotonic() - t0, err))
            i += 1


def _poll_ready(http: str, stop: threading.Event, log: Log) -> None:
    while not stop.is_set():
        t = time.monotonic()
        try:
            with urllib.request.urlopen(f"http://{http}/ready", timeout=5) as r:
                status, degraded = r.status, bool(json.loads(r.read()).get("degraded"))
        except urllib.error.HTTPError as e:
            status, degraded = e.code, False
        except OSError:
            status, degraded = 0, False
        with log.lock:
            log.ready.append((t, status, degraded))
        stop.wait(0.05)


def _first(ready: list[tuple[float, int, bool]], after: float, degraded: bool) -> float | None:
    return next((t - after for t, _, d in ready if t >= after and d == degraded), None)


def run(args: argparse.Namespace, report) -> dict:
    from deploy.launcher import ClusterConfig, LocalCluster
    from engine.config import EngineConfig

    if args.streams < 1 or args.seconds <= 0 or args.freeze_s <= 0 or args.prompt_tokens < 65:
        raise SystemExit("--streams >= 1, --seconds > 0, --freeze-s > 0 and --prompt-tokens > 64 please")
    cfg = ClusterConfig(engine=EngineConfig(model=args.model, dtype="float32"), host="127.0.0.1", grpc_port=0,
                        http_port=0, dashboard_port=0)
    shared = [(7 * i) % 4000 + 100 for i in range(64)]
    prompts = [shared + [(31 * i + 13 * j) % 4000 + 100 for j in range(args.prompt_tokens - 64)] for i in range(8)]
    log, stop = Log(), threading.Event()
    cluster = LocalCluster(cfg, report.progress).start()
    try:
        router, redis_server = cluster.router, cluster.redis
        threads = [threading.Thread(target=_client, args=(router.address, prompts, args.max_tokens, k, stop, log),
                                    daemon=True) for k in range(args.streams)]
        threads.append(threading.Thread(target=_poll_ready, args=(router.http_address, stop, log), daemon=True))
        report.progress(f"{args.streams} streams: {args.seconds:.0f} s before the freeze")
        t_start = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        report.progress(f"SIGSTOP redis-server (pid {redis_server.pid}) for {args.freeze_s:.0f} s")
        with redis_server.frozen():
            t_freeze = time.monotonic()
            time.sleep(args.freeze_s)
        t_thaw = time.monotonic()
        report.progress(f"SIGCONT; {args.seconds:.0f} s after")
        time.sleep(args.seconds)
        stop.set()
        for t in threads:
            t.join(150)
        metrics, labels = router.orchestrator.metrics.registry, {"model_name": router.config.model_name}
        failures = metrics.get_sample_value("pdserve:index_lookup_failures_total", labels)
        skipped = metrics.get_sample_value("pdserve:index_lookups_skipped_total", labels)
    finally:
        stop.set()
        cluster.stop()
    bounds = {"before": (t_start, t_freeze), "frozen": (t_freeze, t_thaw), "after": (t_thaw, float("inf"))}
    phases = {}
    for name, (lo, hi) in bounds.items():
        rows = [r for r in log.requests if lo <= r[0] < hi]
        ok = [s for _, s, e in rows if e is None]
        phases[name] = {"requests": len(ok), "errors": len(rows) - len(ok),
                        "p50_s": nearest_rank(ok, 0.5), "p99_s": nearest_rank(ok, 0.99), "max_s": max(ok, default=None)}
    p50_before, p50_frozen = phases["before"]["p50_s"], phases["frozen"]["p50_s"]
    result = {
        "streams": args.streams, "freeze_s": args.freeze_s, "phases": phases,
        "degraded_after_s": _first(log.ready, t_freeze, True),
        "recovered_s": _first(log.ready, t_thaw, False),
        "ready_503": sum(1 for _, status, _ in log.ready if status != 200),
        "p50_ratio_frozen": round(p50_frozen / p50_before, 3) if p50_before and p50_frozen else None,
        "lookup_failures": failures, "lookups_skipped": skipped,
        "error_samples": [e for _, _, e in log.requests if e][:5],
    }
    report.table(["phase", "requests", "errors", "p50_s", "p99_s", "max_s"],
                 [[n, p["requests"], p["errors"], p["p50_s"], p["p99_s"], p["max_s"]] for n, p in phases.items()])
    report.table(["figure", "value"], [[k, v] for k, v in result.items() if k not in ("phases", "error_samples")])
    return result
