"""The cluster chaos runs on: `pdserve up`'s LocalCluster (Redis, local Ray, node actors, the
router in this process), with every decode node reached through its own loopback proxy
(chaos/proxy.py: the node binds a fixed port and advertises the proxy's), and the
figures chaos reads off it: who is registered, the router's migration counters, the pids to
freeze. ``router_process`` swaps the in-process router for ``python -m frontend.server`` on the same
ports (restart-router, the nemesis) and back; ``router_replicas`` for several such processes on
one port (restart-router-replicas).

    router --> proxy decode-0 --> decode-0        prefill-0 --(KV: shm / tcp / gRPC)--> decode-k
           --> proxy decode-1 --> decode-1
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from chaos.faults import FREEZER
from chaos.proxy import SilentProxy
from deploy.redis_server import free_port

# Redis calls made by chaos itself answer within this (Redis may be the frozen process).
REDIS_TIMEOUT_S = 2.0


class ChaosCluster:
    """A started LocalCluster with proxied decode nodes; a context manager."""

    def __init__(self, config, progress: Callable[[str], None] = lambda m: None, proxied: bool = True) -> None:
        self.config = config
        self.progress = progress
        self.proxies: dict[str, SilentProxy] = {}
        node_fields = {}
        if proxied:
            for i in range(config.decode_nodes):
                port = free_port(config.host)
                self.proxies[f"decode-{i}"] = SilentProxy(f"{config.host}:{port}", host=config.host)
                node_fields[f"decode-{i}"] = {"grpc_port": port, "advertise_grpc_port": self.proxies[f"decode-{i}"].port}
        from deploy.launcher import LocalCluster

        self.local = LocalCluster(config, progress, node_fields)
        self.router_proc = None  # a RouterProcess while one serves instead of the in-process router

    # ---- lifecycle
    def start(self) -> "ChaosCluster":
        try:
            self.local.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        FREEZER.thaw_all()  # nothing this run stopped stays stopped
        for p in self.proxies.values():
            p.resume()
        if self.router_proc is not None:
            self.router_proc.cleanup()
            self.router_proc = None
        try:
            self.local.stop()
        finally:
            for p in self.proxies.values():
                p.close()

    def __enter__(self) -> "ChaosCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- what scenarios use
    @property
    def actors(self) -> dict:
        return self.local.actors

    def role_actors(self, role: str) -> dict:
        return {nid: a for nid, a in self.local.actors.items() if nid.startswith(role)}

    @property
    def router(self):
        """The in-process RouterServer (None while a router process serves)."""
        return self.local.router

    @property
    def address(self) -> str:
        return self.router_proc.address if self.router_proc is not None else self.local.address

    @property
    def http_address(self) -> str | None:
        return self.router_proc.http_address if self.router_proc is not None else self.local.http_address

    @property
    def redis(self):
        return self.local.redis

    @property
    def namespace(self) -> str:
        return self.config.namespace

    def redis_client(self):
        from kv_index.client import RedisTimeouts, redis_client

        return redis_client(self.local.redis_url, RedisTimeouts(REDIS_TIMEOUT_S, REDIS_TIMEOUT_S))

    def registered(self) -> dict[str, str]:
        """node id -> registered gRPC address ({} while Redis does not answer)."""
        import redis

        from kv_index.reader import IndexReader

        r = self.redis_client()
        try:
            return {nid: n.grpc_address for nid, n in IndexReader(r, self.namespace).live_nodes().items()}
        except redis.RedisError:
            return {}
        finally:
            r.close()

    def index_blocks(self) -> int:
        """Block entries the nodes hold in the index (their published snapshots)."""
        from kv_index.schema import node_entries

        r = self.redis_client()
        try:
            return sum(node_entries(r, self.namespace, self.local.actors).values())
        finally:
            r.close()

    def migrations(self) -> dict[str, float]:
        """The router's ``pdserve:request_migrations_total`` by reason (in-process router, or
        the router process's /metrics)."""
        if self.router_proc is not None:
            return _scrape_migrations(self.router_proc.http_address)
        from telemetry.metrics import MIGRATIONS

        orch = self.local.router.orchestrator
        reg, model = orch.metrics.registry, orch.config.model_name
        return {r: reg.get_sample_value("pdserve:request_migrations_total", {"model_name": model, "reason": r}) or 0.0
                for r in MIGRATIONS}

    def moved(self) -> float:
        """Requests moved to another node so far (every migration reason but ``gave_up``)."""
        return sum(v for k, v in self.migrations().items() if k != "gave_up")

    # ---- the router as its own process
    @contextlib.contextmanager
    def router_process(self, **settings):
        """Serve through ``python -m frontend.server`` on the in-process router's ports for the
        block, then through an in-process router again (with its own settings). ``settings``:
        RouterConfig fields the process runs with instead, as its flags (the negative control
        in tests/test_chaos.py: ``max_migrations=0``, a router that moves nothing)."""
        from dataclasses import replace

        from deploy.router_process import RouterProcess
        from frontend.server import serve

        old = self.local.router
        cfg = old.config
        port = int(old.address.rsplit(":", 1)[1])
        http_port = int(old.http_address.rsplit(":", 1)[1]) if old.http_address else None
        proc = RouterProcess(replace(cfg, **settings), port, http_port)  # a bad setting raises here, none stopped
        old.stop()
        self.local.router = None
        self.router_proc = proc
        try:
            self.router_proc.start()
            self.wait_serving()
            yield self.router_proc
        finally:
            if self.router_proc is not None:
                self.router_proc.cleanup()
                self.router_proc = None
            self.local.router = serve(replace(cfg, port=port, http_port=http_port))
            self.wait_serving()

    @contextlib.contextmanager
    def router_replicas(self, n: int = 2):
        """Serve through ``n`` router processes on the in-process router's ports, all bound with
        SO_REUSEPORT (the kernel spreads new connections over them) and sharing their load
        through Redis, as `pdserve up --routers n` runs them; yields the processes. The
        in-process router comes back after the block."""
        from dataclasses import replace

        from deploy.router_process import RouterProcess
        from frontend.server import serve

        old = self.local.router
        # Records every 0.1 s: the scenario picks its victim by the requests they say it holds.
        cfg = replace(old.config, reuse_port=True, node_refresh_s=0.1)
        port = int(old.address.rsplit(":", 1)[1])
        http_port = int(old.http_address.rsplit(":", 1)[1]) if old.http_address else None
        procs = [RouterProcess(cfg, port, http_port) for _ in range(n)]
        old.stop()
        self.local.router = None
        self.router_proc = procs[0]  # the address; every replica has the same
        try:
            for p in procs:
                p.start()
            self.wait_serving()
            yield procs
        finally:
            for p in procs:
                p.cleanup()
            self.router_proc = None
            self.local.router = serve(replace(old.config, port=port, http_port=http_port))
            self.wait_serving()

    def router_records(self) -> dict[str, dict]:
        """The live router replicas' load records (router/replicas.py; {} while Redis does not answer)."""
        import redis

        from router.replicas import read_replicas

        r = self.redis_client()
        try:
            return read_replicas(r, self.namespace, prune=False)
        except redis.RedisError:
            return {}
        finally:
            r.close()

    def restart_router_process(self) -> float:
        """Start the killed router process again on its ports; returns when it listens."""
        self.router_proc.start()
        return time.monotonic()

    def wait_serving(self, timeout_s: float = 60.0) -> None:
        """Until the router answers health with SERVING (it sees a live decode node)."""
        import pdserve

        deadline = time.monotonic() + timeout_s
        with pdserve.Client(self.address, timeout=5, retries=0) as c:
            while True:
                try:
                    if c.health():
                        return
                except pdserve.PdServeError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the router at {self.address} did not report SERVING in {timeout_s} s")
                time.sleep(0.2)

    def settle(self, timeout_s: float = 60.0) -> float | None:
        """Until the cluster is back to where a scenario starts: every node registered and the
        router leaving none out of placement (a node that failed a moment ago stays excluded for
        ``exclude_failed_node_s``; a scenario that needs it, kill-prefill after freeze-prefill,
        would wait in vain). Seconds waited, None if not within ``timeout_s``."""
        since = time.monotonic()

        def ok() -> bool:
            if set(self.registered()) != set(self.actors):
                return False
            orch = self.router.orchestrator if self.router is not None else None
            return orch is None or not orch.exclusions.active(time.monotonic())

        return wait_for(ok, since, timeout_s)

    def wait_registered(self, node_ids, since: float, timeout_s: float,
                        address_changed_from: dict[str, str] | None = None) -> float | None:
        """Seconds from ``since`` until every one of ``node_ids`` is registered (at a new
        address, for those in ``address_changed_from``: a restarted actor's new life); None if
        not within ``timeout_s`` (0: do not wait)."""
        old = address_changed_from or {}

        def ok() -> bool:
            reg = self.registered()
            return all(nid in reg and reg[nid] != old.get(nid) for nid in node_ids)

        return wait_for(ok, since, timeout_s)


def wait_for(cond: Callable[[], bool], since: float, timeout_s: float, every_s: float = 0.2) -> float | None:
    """Seconds from ``since`` until ``cond()``; None if not within ``timeout_s``."""
    while not cond():
        if time.monotonic() > since + timeout_s:
            return None
        time.sleep(every_s)
    return round(time.monotonic() - since, 3)


def _scrape_migrations(http_address: str | None) -> dict[str, float]:
    import urllib.request

    if http_address is None:
        return {}
    try:
        with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=2) as resp:
            return parse_migrations(resp.read().decode())
    except OSError:
        return {}


def parse_migrations(text: str) -> dict[str, float]:
    """``pdserve:request_migrations_total{...,reason="x"} 3.0`` lines of a Prometheus text page
    -> {"x": 3.0}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve:request_migrations_total{"):
            labels, _, value = line.rpartition(" ")
            reason = labels.split('reason="', 1)[1].split('"', 1)[0] if 'reason="' in labels else ""
            out[reason] = out.get(reason, 0.0) + float(value)
    return out


class FirstIncrease:
    """Watches a counter from a thread, from ``arm()`` (just before a fault) until ``stop()``:
    ``since(t)`` is the seconds from ``t`` until it first grew past its value at arming (None:
    it did not). Polls every ``every_s``."""

    def __init__(self, read: Callable[[], float], every_s: float = 0.05) -> None:
        self._read = read
        self._every_s = every_s
        self._base = 0.0
        self.grew_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self) -> "FirstIncrease":
        self._base = self._safe_read()
        self._thread = threading.Thread(target=self._run, name="chaos-watch", daemon=True)
        self._thread.start()
        return self

    def _safe_read(self) -> float:
        try:
            return self._read()
        except Exception:  # noqa: BLE001 - a router mid-restart has no figures for a moment
            return self._base

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            if self._safe_read() > self._base:
                self.grew_at = time.monotonic()
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def since(self, t: float) -> float | None:
        return round(self.grew_at - t, 3) if self.grew_at is not None else None
