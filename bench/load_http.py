"""`pdserve bench load --http --overload N`: the router's HTTP front under N times the
concurrency it admits, every request a body of the largest size it accepts.

    pdserve bench load --http --overload 10 --json          # 60 s (the default --seconds)
    pdserve bench load --http --overload 2 --seconds 5      # smoke run

The cluster is `pdserve up`'s parts on loopback (Redis, a local Ray, ``--prefill-nodes`` and
``--decode-nodes`` node actors, one each by default, on a tiny random Llama with SmolLM2's
vocabulary and tokenizer), and the router under
test is a `python -m frontend.server` process of its own, as in the chart's router pod, so its
RSS is the router's alone. Its context is SmolLM2's (8192 tokens), so its body limit is the
default builtin model's (frontend/http_budget.py). The load is another process: ``--overload``
times the router's admitted HTTP requests (``rpc_limit``: 2 * max_inflight + 64) as
closed-loop clients, each sending POST /v1/completions with a body of exactly the body limit
(a short prompt, 4 output tokens, and a long ``user`` string that the router parses and keeps
as it would a prompt) and every ``--too-large-every``-th one byte over it. A 429 waits its
``retry-after-ms``, as the official client does; everything else sends again at once.

    answered / done / rejected_429 / too_large_413   responses, by status
    errors                  any other status, a connection cut without an answer, no answer
                            in --request-timeout: each one a request lost (target 0)
    router_rss_idle_mb      the router's RSS before the load
    router_rss_peak_mb      its highest RSS sampled (every 0.1 s) during the load
    router_rss_bound_mb     the stated bound (--rss-bound-mb, default 1024: the chart's
                            router memory limit); within_bound says whether the peak kept it
    router_cpu_s, load_cpu_s
                            CPU seconds the router and the load process used over the run
                            (they share the machine: a starved load process is a slow client)
    router_refusals         the router's requests_rejected_total by reason: the front door's
                            (http_overloaded, body_budget, body_too_large, body_timeout) and
                            the orchestrator's (overloaded: max_inflight, or a node refused)

Only loopback addresses are used; nothing leaves the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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

MAX_MODEL_LEN = 8192  # SmolLM2-135M's, the builtin model: its body limit is the one under test
WRITE_CHUNK = 256 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http", action="store_true",
                   help="load the router's HTTP front with maximum-size bodies (this module) instead of gRPC streams")
    p.add_argument("--overload", type=float, default=10.0,
                   help="--http: clients as a multiple of the requests the router admits at once")
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


# -- the client process -------------------------------------------------------------------------
def request_body(size: int) -> bytes:
    """A valid completions request of exactly ``size`` bytes."""
    base = {"model": "", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "user": ""}
    body = json.dumps(base).encode()
    if len(body) > size:
        raise ValueError(f"a body of {size} bytes cannot hold the request ({len(body)} bytes)")
    return body.replace(b'"user": ""', b'"user": "' + b"u" * (size - len(body)) + b'"')


class _Exchange(asyncio.Protocol):
    """One request on its own connection: the response is kept whatever happens to the socket
    afterwards (a server that answers before reading the body may reset the connection)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.buf = bytearray()
        self.done = loop.create_future()
        self.writable = asyncio.Event()
        self.writable.set()
        self.transport = None
        self.status: int | None = None
        self.headers: dict[str, str] = {}

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.done.done():
            return
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
        if len(self.buf) - end - 4 >= int(headers.get("content-length", "0")):
            self.status, self.headers = int(lines[0].split(" ", 2)[1]), headers
            self.done.set_result(True)

    def connection_lost(self, exc) -> None:
        self.writable.set()
        if not self.done.done():
            self.done.set_result(False)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()


class ClientStats:
    def __init__(self) -> None:
        self.status: dict[int, int] = {}
        self.lost = 0
        self.samples: list[str] = []

    def error(self, what: str) -> None:
        self.lost += 1
        if len(self.samples) < 5:
            self.samples.append(what[:300])


async def _one(host: str, port: int, head: bytes, body: memoryview, timeout: float, stats: ClientStats):
    """One request; returns its response headers, or None when it got no answer."""
    loop = asyncio.get_running_loop()
    try:
        _, ex = await asyncio.wait_for(loop.create_connection(lambda: _Exchange(loop), host, port), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        stats.error(f"connect: {type(e).__name__}: {e}")
        return None
    try:
        ex.transport.write(head)
        for off in range(0, len(body), WRITE_CHUNK):
            await ex.writable.wait()
            if ex.done.done() or ex.transport.is_closing():
                break  # answered (or cut off) before the body was all sent: the server refused it
            ex.transport.write(body[off:off + WRITE_CHUNK])
        await asyncio.wait_for(asyncio.shield(ex.done), timeout)
    except asyncio.TimeoutError:
        stats.error(f"no answer in {timeout:g} s")
        return None
    finally:
        if not ex.transport.is_closing():
            ex.transport.abort()  # what is left of the body is not sent: close() would send it first
    if ex.status is None:
        stats.error(f"the connection closed without an answer ({len(ex.buf)} bytes came)")
        return None
    stats.status[ex.status] = stats.status.get(ex.status, 0) + 1
    if ex.status not in (200, 413, 429) and len(stats.samples) < 5:
        stats.samples.append(f"HTTP {ex.status}: {bytes(ex.buf[-300:])!r}")
    return ex


async def _client(host: str, port: int, body_bytes: int, too_large_every: int, stop_at: float, timeout: float,
                  seed: int, stats: ClientStats, counter: list[int]) -> None:
    body = memoryview(request_body(body_bytes) + b" ")  # one byte more: the over-limit body (413)
    rng = random.Random(seed)
    await asyncio.sleep(rng.random())  # the clients start spread over a second, not in one burst
    while time.monotonic() < stop_at:
        counter[0] += 1
        size = body_bytes + 1 if too_large_every and counter[0] % too_large_every == 0 else body_bytes
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {size}\r\nConnection: close\r\n\r\n").encode()
        ex = await _one(host, port, head, body[:size], timeout, stats)
        if ex is not None and ex.status == 429:
            wait_ms = int(ex.headers.get("retry-after-ms", "1000"))
            await asyncio.sleep(min(wait_ms / 1000 * (0.5 + rng.random()), max(0.0, stop_at - time.monotonic())))


async def _client_main(a: argparse.Namespace) -> dict:
    host, port = a.url.rsplit(":", 1)
    stats, counter = ClientStats(), [0]
    stop_at = time.monotonic() + a.seconds
    await asyncio.gather(*(_client(host, int(port), a.body_bytes, a.too_large_every, stop_at, a.request_timeout,
                                   a.seed + i, stats, counter) for i in range(a.clients)))
    return {"requests": counter[0], "status": stats.status, "lost": stats.lost, "samples": stats.samples}


def client_main(argv: list[str] | None = None) -> int:
    """``python -m bench.load_http``: the load, in a process of its own; one JSON line."""
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--body-bytes", type=int, required=True)
    p.add_argument("--too-large-every", type=int, default=10)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    print(json.dumps(asyncio.run(_client_main(p.parse_args(argv)))), flush=True)
    return 0


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


def run(args: argparse.Namespace, report) -> dict:
    import psutil

    from bench.tiny_model import tiny_model_with_tokenizer
    from deploy.launcher import ClusterConfig, LocalCluster
    from engine.config import CacheConfig, EngineConfig

    admitted = 2 * args.max_inflight + 64  # RouterConfig.rpc_limit
    clients = max(1, round(args.overload * admitted))
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
            rss_idle = psutil.Process(router.proc.pid).memory_info().rss / 2**20
            report.progress(f"router pid {router.proc.pid} on {router.http}: admits {admitted} requests, body limit "
                            f"{body_bytes} bytes, RSS {rss_idle:.0f} MB idle; {clients} clients for "
                            f"{args.seconds:g} s")
            rss: list[float] = []
            cpu0 = _cpu_s(psutil.Process(router.proc.pid))
            children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            stop = threading.Event()
            sampler = threading.Thread(target=_sample_rss, args=(router.proc.pid, stop, rss), daemon=True)
            sampler.start()
            try:
                load = subprocess.run(
                    [sys.executable, "-m", "bench.load_http", "--url", router.http, "--clients", str(clients),
                     "--seconds", str(args.seconds), "--body-bytes", str(body_bytes), "--too-large-every",
                     str(args.too_large_every), "--request-timeout", str(args.request_timeout),
                     "--seed", str(args.seed)],
                    capture_output=True, text=True, timeout=args.seconds + 2 * args.request_timeout + 120)
            finally:
                stop.set()
                sampler.join()
            if load.returncode != 0:
                raise RuntimeError(f"the load process failed: {load.stderr[-2000:]}")
            out = json.loads(load.stdout.strip().splitlines()[-1])
            rss_end = psutil.Process(router.proc.pid).memory_info().rss / 2**20
            router_cpu = _cpu_s(psutil.Process(router.proc.pid)) - cpu0
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            load_cpu = children.ru_utime + children.ru_stime - children0.ru_utime - children0.ru_stime
            refusals = router.refusals()
        finally:
            if router is not None:
                router.stop()
            cluster.stop()
    status = {int(k): v for k, v in out["status"].items()}
    done, r429, r413 = status.get(200, 0), status.get(429, 0), status.get(413, 0)
    peak = max(rss) if rss else rss_idle
    result = {
        "mode": "http", "admitted": admitted, "clients": clients, "overload": args.overload, "seconds": args.seconds,
        "body_bytes": body_bytes, "requests": out["requests"], "answered": sum(status.values()), "done": done,
        "rejected_429": r429, "too_large_413": r413,
        "errors": out["lost"] + sum(v for k, v in status.items() if k not in (200, 413, 429)),
        "status": {str(k): v for k, v in sorted(status.items())}, "router_refusals": refusals,
        "router_rss_idle_mb": round(rss_idle, 1), "router_rss_peak_mb": round(peak, 1),
        "router_rss_end_mb": round(rss_end, 1), "router_rss_bound_mb": args.rss_bound_mb,
        "within_bound": peak < args.rss_bound_mb,
        "router_cpu_s": round(router_cpu, 1), "load_cpu_s": round(load_cpu, 1),
    }
    report.table(["figure", "value"], [[k, v] for k, v in result.items()])
    if out["samples"]:
        report.progress("errors, first ones: " + " | ".join(out["samples"]))
    return {**result, "error_samples": out["samples"]}


if __name__ == "__main__":
    raise SystemExit(client_main())
