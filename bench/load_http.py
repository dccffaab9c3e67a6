"""`pdserve bench load --http --overload N`: the router's HTTP front under N times the
concurrency it admits, every request a body of the largest size it accepts, against the same
router at 1x first.

    pdserve bench load --http --overload 10 --json          # 2 x 60 s (the default --seconds)
    pdserve bench load --http --overload 2 --seconds 5      # smoke run

The cluster is `pdserve up`'s parts on loopback (Redis, a local Ray, ``--prefill-nodes`` and
``--decode-nodes`` node actors, one each by default, on a tiny random Llama with SmolLM2's
vocabulary and tokenizer), and the router under
test is a `python -m frontend.server` process of its own, as in the chart's router pod, so its
RSS is the router's alone. Its context is SmolLM2's (8192 tokens), so its body limit is the
default builtin model's (frontend/http_budget.py). The load is another process
(bench/load_http_client.py): closed-loop clients, each sending POST /v1/completions with a body
of exactly the body limit (a short prompt, 4 output tokens with ``ignore_eos``, and a long
``user`` string that the router parses and keeps as it would a prompt) and every
``--too-large-every``-th one byte over it. It runs twice for ``--seconds`` each: first as many
clients as the router admits at once (``rpc_limit``: 2 * max_inflight + 64), the reference,
then ``--overload`` times that. Every 200's body is checked (bench/load_check.py).

    answered / done / bad_200 / rejected_429 / too_large_413
                            responses, by status; done: 200s carrying the completion asked
                            for, bad_200: 200s that did not (target 0)
    errors                  any other status, a connection cut without an answer, no answer
                            in --request-timeout: each one a request lost (target 0)
    done_per_s, done_per_s_at_1x, done_ratio_vs_1x
                            good 200s answered within the window, per second, at --overload
                            and at 1x; their ratio (target >= load_check.DONE_RATIO_MIN)
    at_1x                   the reference level's figures
    router_rss_idle_mb      the router's RSS before the load
    router_rss_peak_mb      its highest RSS sampled (every 0.1 s) over both levels
    router_rss_bound_mb     the stated bound (--rss-bound-mb, default 1024: the chart's
                            router memory limit); within_bound says whether the peak kept it
    router_cpu_s, load_cpu_s
                            CPU seconds the router and the load process used over the level
                            (they share the machine: a starved load process is a slow client)
    router_refusals         the router's requests_rejected_total by reason over the level:
                            the front door's (http_overloaded, body_budget, body_too_large,
                            body_timeout) and the orchestrator's (overloaded: max_inflight, or
                            a node refused)
    checks, passed          the verdict (bench/load_check.py): passed only if every check holds

Only loopback addresses are used; nothing leaves the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.load_check import DONE_RATIO_MIN, MAX_TOKENS, level_figures, verdict
from bench.load_http_client import run_load

MAX_MODEL_LEN = 8192  # SmolLM2-135M's, the builtin model: its body limit is the one under test


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http", action="store_true",
                   help="load the router's HTTP front with maximum-size bodies (this module) instead of gRPC streams")
    p.add_argument("--overload", type=float, default=10.0,
                   help="--http: clients as a multiple of the requests the router admits at once")
    p.add_argument("--done-ratio-min", type=float, default=DONE_RATIO_MIN,
                   help="--http: done/s at --overload must reach this x done/s at 1x (0: reported, not checked)")
    p.add_argument("--max-inflight", type=int, default=256,
                   help="--http: the router's --max-inflight (it admits 2 * this + 64 HTTP requests at once)")
    p.add_argument("--too-large-every", type=int, default=10,
                   help="--http: every Nth request is one byte over the body limit (413); 0: none")
    p.add_argument("--rss-bound-mb", type=float, default=1024.0,
                   help="--http: the router RSS the run must stay under (the chart's router limit)")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="--http: seconds a client waits for an answer before counting the request lost")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the router process and the run ---------------------------------------------------------------
class RouterProcess:
    """``python -m frontend.server`` against the cluster's Redis, HTTP on a free port."""

    def __init__(self, cluster, model_dir: Path, max_inflight: int) -> None:
        from urllib.parse import unquote, urlsplit

        url = urlsplit(cluster.redis_url)
        self.http = f"127.0.0.1:{_free_port()}"
        args = [sys.executable, "-m", "frontend.server", "--redis-url", f"redis://{url.hostname}:{url.port}/0",
                "--namespace", cluster.config.namespace, "--tokenizer-dir", str(model_dir), "--model-name",
                cluster.config.engine.model, "--max-model-len", str(MAX_MODEL_LEN), "--port", "0", "--http-port",
                self.http.rsplit(":", 1)[1], "--max-inflight", str(max_inflight), "--drain-timeout", "1",
                "--ready-min-prefill", str(min(1, cluster.config.prefill_nodes))]
        env = dict(os.environ, PDSERVE_REDIS_PASSWORD=unquote(url.password or ""))
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()  # the router never blocks on a full pipe

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            del self.log[:-50]

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("the router exited: " + "".join(self.log[-10:]))
            try:
                with urllib.request.urlopen(f"http://{self.http}/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the router was not ready within {timeout_s:g} s")

    def body_limit(self) -> int:
        """The router's own body limit: one byte over it is refused 413 naming it."""
        req = urllib.request.Request(f"http://{self.http}/v1/completions", data=b"", method="POST",
                                     headers={"Content-Length": str(1 << 40), "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=10)
        except urllib.error.HTTPError as e:
            message = json.loads(e.read())["error"]["message"]
            return int(message.split("at most ", 1)[1].split(" ", 1)[0])
        raise RuntimeError("a body of 1 TiB was not refused")

    def warm_up(self) -> None:
        """One small completion before the reference level, so that it does not pay the first
        request's costs alone (whatever it answers: the levels count and check the answers)."""
        body = json.dumps({"prompt": "Hello", "max_tokens": MAX_TOKENS, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://{self.http}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60).read()
        except OSError:
            pass

    def refusals(self) -> dict[str, int]:
        """The router's own count of refusals, by reason (pdserve:requests_rejected_total)."""
        with urllib.request.urlopen(f"http://{self.http}/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("pdserve:requests_rejected_total{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                out[reason] = int(float(line.rsplit(" ", 1)[1]))
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _cpu_s(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _sample_rss(pid: int, stop: threading.Event, out: list[float]) -> None:
    import psutil

    proc = psutil.Process(pid)
    while not stop.is_set():
        try:
            out.append(proc.memory_info().rss / 2**20)
        except psutil.Error:
            return
        stop.wait(0.1)




def _level(args, router: RouterProcess, overload: float, admitted: int, body_bytes: int) -> tuple[dict, dict]:
    """``overload`` x ``admitted`` clients for ``args.seconds``: the level's figures (with the
    router's and the load's CPU and the router's refusals over it) and the load's JSON line."""
    import psutil

    clients = max(1, round(overload * admitted))
    proc = psutil.Process(router.proc.pid)
    refusals0, cpu0 = router.refusals(), _cpu_s(proc)
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = run_load(router.http, clients, args.seconds, body_bytes, args.too_large_every, args.request_timeout,
                   args.seed)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    refusals = router.refusals()
    figures = level_figures(out, clients, args.seconds)
    figures["router_cpu_s"] = round(_cpu_s(proc) - cpu0, 1)
    figures["load_cpu_s"] = round(children.ru_utime + children.ru_stime - children0.ru_utime - children0.ru_stime, 1)
    figures["router_refusals"] = {k: v - refusals0.get(k, 0) for k, v in refusals.items() if v > refusals0.get(k, 0)}
    return figures, out


def _measure(args, router: RouterProcess, admitted: int, body_bytes: int, report) -> tuple[list, list[float]]:
    """The reference level (1x), then --overload, the router's RSS sampled over both."""
    rss: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_rss, args=(router.proc.pid, stop, rss), daemon=True)
    sampler.start()
    levels = []
    try:
        for overload in (1.0, args.overload):
            report.progress(f"{max(1, round(overload * admitted))} clients ({overload:g}x) for {args.seconds:g} s")
            levels.append(_level(args, router, overload, admitted, body_bytes))
            report.progress(f"{overload:g}x: {levels[-1][0]['done_per_s']} done/s")
    finally:
        stop.set()
        sampler.join()
    return levels, rss


def _samples(levels: list, key: str) -> list[str]:
    return [f"{name}: {s}" for name, (_, out) in zip(("1x", "overload"), levels) for s in out[key]]


def run(args: argparse.Namespace, report) -> dict:
    import psutil

    from bench.tiny_model import tiny_model_with_tokenizer
    from deploy.launcher import ClusterConfig, LocalCluster
    from engine.config import CacheConfig, EngineConfig

    admitted = 2 * args.max_inflight + 64  # RouterConfig.rpc_limit
    with tempfile.TemporaryDirectory(prefix="pdserve-load-http-") as tmp:
        report.progress("building the tiny model")
        model = tiny_model_with_tokenizer(Path(tmp), max_position_embeddings=MAX_MODEL_LEN)
        engine = EngineConfig(model=str(model), dtype="float32", cache=CacheConfig(block_size=16, num_blocks=2048))
        cfg = ClusterConfig(engine=engine, prefill_nodes=args.prefill_nodes, decode_nodes=args.decode_nodes,
                            host="127.0.0.1", grpc_port=0, http_port=None, dashboard_port=0, short_prompt_tokens=64)
        cluster = LocalCluster(cfg, report.progress).start()
        router = None
        try:
            router = RouterProcess(cluster, cluster.model_dir or model, args.max_inflight)
            router.wait_ready()
            body_bytes = router.body_limit()
            router.warm_up()
            rss_idle = psutil.Process(router.proc.pid).memory_info().rss / 2**20
            report.progress(f"router pid {router.proc.pid} on {router.http}: admits {admitted} requests, body limit "
                            f"{body_bytes} bytes, RSS {rss_idle:.0f} MB idle")
            levels, rss = _measure(args, router, admitted, body_bytes, report)
            rss_end = psutil.Process(router.proc.pid).memory_info().rss / 2**20
        finally:
            if router is not None:
                router.stop()
            cluster.stop()
    (at_1x, _), (over, _) = levels
    peak = max(rss + [rss_idle])
    result = {
        "mode": "http", "admitted": admitted, "overload": args.overload, "seconds": args.seconds,
        "body_bytes": body_bytes, **over, "router_rss_idle_mb": round(rss_idle, 1),
        "router_rss_peak_mb": round(peak, 1), "router_rss_end_mb": round(rss_end, 1),
        "router_rss_bound_mb": args.rss_bound_mb, "within_bound": peak < args.rss_bound_mb,
    }
    result.update(verdict(at_1x, over, result["within_bound"], args.done_ratio_min), at_1x=at_1x)
    report.table(["figure", "value"], [[k, v] for k, v in result.items()])
    errors, bad = _samples(levels, "samples"), _samples(levels, "bad_samples")
    if errors or bad:
        report.progress("first errors and bad 200s: " + " | ".join(errors + bad))
    if not result["passed"]:
        report.progress("FAILED: " + ", ".join(k for k, ok in result["checks"].items() if not ok))
    return {**result, "error_samples": errors, "bad_200_samples": bad}
