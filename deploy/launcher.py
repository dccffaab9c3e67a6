"""`pdserve up`: the whole cluster on one machine.

    redis-server (private, loopback)   <- or --redis-url
    local Ray (dashboard on 127.0.0.1) with two custom resources: prefill_pool, decode_pool
      prefill-0 .. prefill-{P-1}   NodeActor running a PrefillServer  (one per prefill_pool unit)
      decode-0  .. decode-{D-1}    NodeActor running a DecodeServer   (one per decode_pool unit)
    router (gRPC on 127.0.0.1:--grpc-port, OpenAI HTTP + /metrics on --http-port), in this
    process, torch-free

When every node has registered, one line goes to stdout so scripts can wait for it:

    pdserve ready grpc=127.0.0.1:50051 http=127.0.0.1:8000 dashboard=http://127.0.0.1:8265 dashboard_token=~/.ray/auth_token

(with ``--tls``, `` tls_ca=PATH`` comes before the token: the throwaway CA clients must trust).
``dashboard_token`` says where the token Ray's dashboard asks for is (``dashboard_login``; left
out when Ray's token authentication is off); a line on stderr says how to get in.

Ctrl-C or SIGTERM drains the router (in-flight requests finish for up to --drain-timeout, new
ones are refused), then stops the actors, Ray and Redis, in that order.

Security (docs/security.md): the private Redis requires a generated password; Ray's dashboard
binds loopback and Ray's token authentication is on unless ``RAY_AUTH_MODE`` says otherwise
(tests set ``disabled``); ``tls=True`` makes a throwaway CA in a 0700 temporary directory and
one certificate that every member (router, nodes) serves and presents (mutual TLS), removed at
stop; ``api_keys`` are what clients must send.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping

from deploy.cluster_config import ClusterConfig, router_config  # noqa: F401 (router_config: part of this module's API)
from deploy.nodes import NodeTemplate, node_id, server_builder
from deploy.pool_runners import LocalPools, local_pool_resources, planner_pools
from deploy.redis_server import RedisServer, free_port
from engine.config import EngineConfig
from kv_index.nodes import Role
from settings.flags import shared_values

# ClusterConfig fields a NodeTemplate has under the same name but that are not the nodes':
# ``grpc_port`` is the router's port here (each node picks a free one); the engine is the one
# bring-up resolved.
NOT_THE_NODES = ("grpc_port", "engine")


def node_template(cfg: ClusterConfig, engine: EngineConfig, redis_url: str, tls: Mapping[str, str]) -> NodeTemplate:
    """The nodes' settings of a local cluster: what ``cfg`` hands the nodes (its fields of the
    same name), the engine and Redis bring-up resolved, the members' TLS files."""
    return NodeTemplate(**{**shared_values(cfg, NodeTemplate, exclude=NOT_THE_NODES), "engine": engine,
                           "redis_url": redis_url, "served_model_name": cfg.engine.model, **tls})


def state_file() -> Path:
    from engine.models.builtin import cache_dir

    return cache_dir() / "cluster.json"


class LocalCluster:
    """Brings up and tears down the embedded cluster; usable as a context manager in tests."""

    def __init__(self, config: ClusterConfig, progress: Callable[[str], None] = lambda m: None,
                 node_fields: Mapping[str, Mapping] | None = None) -> None:
        self.config = config
        self.progress = progress
        # NodeConfig fields of particular nodes, by node id (`pdserve chaos` puts one decode
        # node behind its loopback proxy: a fixed gRPC port, the proxy's port advertised).
        self.node_fields = dict(node_fields or {})
        self.redis = None  # the RedisServer or RedisClusterServer it started
        self.redis_url: str | None = config.redis_url
        self.router = None
        self.router_procs: list = []  # deploy.router_process.RouterProcess: replicas 2..N
        self.actors: dict[str, object] = {}
        self.node_configs: dict[str, object] = {}  # node id -> the NodeConfig it was spawned with
        self.node_addresses: dict[str, str] = {}
        self.dashboard_url: str | None = None
        self.model_dir: Path | None = None
        self.tls = None  # security.tls.TlsFiles of every member when config.tls
        self.pools = None  # deploy.pool_controller.LocalPools while the planner resizes pools
        self._tls_dir: Path | None = None
        self._ray_started = False

    # ------------------------------------------------------------------ bring-up
    def start(self) -> "LocalCluster":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        from deploy.forking import disable_grpc_fork_support

        disable_grpc_fork_support()  # effective only if this process has not used gRPC yet
        # Ray's control plane runs code it is sent: token authentication keeps other local
        # users out of it. Explicit, so a Ray default changing does not turn it off. Set before
        # ray is imported: ray reads it at import, and a driver imported without it starts a
        # GCS that wants a token while it sends none ("InvalidAuthToken", `make run` failed so).
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray

        from engine.models.loader import read_model_config, resolve_source
        from frontend.server import serve

        cfg = self.config
        # Convert a builtin or GGUF model once here, so the nodes don't race to do it.
        model_dir = self.model_dir = resolve_source(cfg.engine.model, progress=self.progress)
        engine_cfg = replace(cfg.engine, model=str(model_dir), num_threads=cfg.node_threads)
        model_cfg = read_model_config(model_dir)

        if self.redis_url is None and cfg.redis_cluster:
            from deploy.redis_cluster import RedisClusterServer

            self.progress(f"starting a Redis Cluster on 127.0.0.1: {cfg.redis_cluster} masters, a replica each")
            self.redis = RedisClusterServer(cfg.redis_cluster, host=cfg.host).start()
            self.redis_url = self.redis.url
        elif self.redis_url is None:
            self.progress("starting redis-server on 127.0.0.1 (password-protected)")
            self.redis = RedisServer(host=cfg.host).start()
            self.redis_url = self.redis.url
        if cfg.tls:
            from security.ca import ThrowawayCA, private_dir

            self._tls_dir = private_dir()
            self.tls = ThrowawayCA(self._tls_dir).issue("member", hosts=("localhost", "127.0.0.1", "::1", cfg.host))
            self.progress(f"TLS on every hop; clients trust the throwaway CA {self.tls.ca_file}")

        self._start_ray(ray)

        # The same node configs `pdserve nodes` spawns on an existing Ray cluster (deploy/nodes.py).
        template = node_template(cfg, engine_cfg, self.redis_url, self._member_tls())
        self._forget_node_health()
        cores = sorted(os.sched_getaffinity(0))
        self._spawn_nodes(template, cores)
        self.progress(f"loading the model on {len(self.actors)} nodes")
        refs = {nid: a.address.remote() for nid, a in self.actors.items()}
        deadline = time.monotonic() + cfg.ready_timeout_s
        for nid, ref in refs.items():
            self.node_addresses[nid] = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            self.progress(f"{nid} serving on {self.node_addresses[nid]}")

        self.progress("starting the router")
        self.router = serve(router_config(
            cfg, redis_url=self.redis_url, model_name=cfg.engine.model, tokenizer_dir=str(model_dir),
            max_model_len=min(model_cfg.max_model_len, cfg.engine.scheduler.max_model_len or 1 << 30),
            **self._member_tls(),
        ))
        self._start_replicas()
        self._wait_registered(deadline)
        if (bounds := planner_pools(cfg)) is not None:  # nodes added and removed to follow the planner
            self.pools = LocalPools(self, template, bounds, cores)
        self._write_state()

    def _start_replicas(self) -> None:
        """Router replicas 2..N: processes bound to the first one's ports (SO_REUSEPORT)."""
        from deploy.router_process import RouterProcess

        n = self.config.routers
        if n <= 1:
            return
        port = int(self.router.address.rsplit(":", 1)[1])  # --grpc-port 0: the one the first bound
        http = self.router.http_address
        http_port = int(http.rsplit(":", 1)[1]) if http else None
        for i in range(1, n):
            self.progress(f"starting router replica {i + 1} of {n} on the same ports")
            self.router_procs.append(RouterProcess(self.router.config, port, http_port).start())

    def _start_ray(self, ray) -> None:
        cfg = self.config
        self.progress("starting Ray")
        dash_port = cfg.dashboard_port or free_port()
        # A tensor-parallel node asks Ray for a CPU per rank (node/config.py ray_actor_options):
        # on this one machine the ranks share the cores, so Ray offers at least as many.
        ranks = cfg.prefill_nodes * cfg.prefill_tensor_parallel + cfg.decode_nodes * cfg.decode_tensor_parallel
        ctx = ray.init(
            namespace=cfg.namespace,
            num_cpus=max(os.cpu_count() or 2, ranks),
            resources=local_pool_resources(cfg),  # room for the largest pools the planner may ask for
            include_dashboard=True,
            dashboard_host=cfg.host,
            dashboard_port=dash_port,
            log_to_driver=False,
            configure_logging=False,
        )
        self._ray_started = True
        self.dashboard_url = f"http://{ctx.dashboard_url}" if ctx.dashboard_url else None

    def _spawn_nodes(self, template: NodeTemplate, cores: list[int]) -> None:
        cfg = self.config
        for role, count in ((Role.PREFILL, cfg.prefill_nodes), (Role.DECODE, cfg.decode_nodes)):
            for i in range(count):
                node = replace(template.config(
                    role, i, cpu_affinity=(cores[len(self.actors) % len(cores)],) if cfg.pin_cores else None),
                    **self.node_fields.get(node_id(role, i), {}))
                self._spawn(node)

    def respawn(self, nid: str, extra_resources: Mapping[str, float] | None = None):
        """End node ``nid``'s actor for good and start it again with the same config, asking
        Ray for ``extra_resources`` too (a host's own resource moves it there: chaos host-loss).
        Returns the new handle; the caller waits for it to register."""
        import ray

        ray.kill(self.actors.pop(nid), no_restart=True)
        return self._spawn(self.node_configs[nid], extra_resources)

    def _spawn(self, node, extra_resources: Mapping[str, float] | None = None):
        from node.actor import spawn_node

        # Nodes ask for no CPU slot: on a small machine the pools, not cores, place them.
        self.actors[node.node_id] = spawn_node(node, server_builder(node.role, node.engine.backend), num_cpus=0,
                                               extra_resources=dict(extra_resources or {}))
        self.node_configs[node.node_id] = node
        return self.actors[node.node_id]

    def _forget_node_health(self) -> None:
        """A new cluster: failures that nodes of an earlier one recorded under this namespace
        (a shared --redis-url) must not count against these (node/start_guard.py); nor may its
        role wishes and pool targets steer these nodes, which take its node ids again
        (kv_index/roles.py: a new generation)."""
        from kv_index.client import redis_client
        from kv_index.health import HealthStore
        from kv_index.roles import start_generation

        r = redis_client(self.redis_url)
        try:
            store = HealthStore(r, self.config.namespace)
            for nid in store.read_all():
                store.clear(nid)
            start_generation(r, self.config.namespace)
        finally:
            r.close()

    def _member_tls(self) -> dict:
        t = self.tls
        return {} if t is None else dict(tls_cert_file=t.cert_file, tls_key_file=t.key_file, tls_ca_file=t.ca_file)

    def _wait_registered(self, deadline: float) -> None:
        from kv_index.client import redis_client
        from kv_index.reader import IndexReader

        reader = IndexReader(redis_client(self.redis_url), self.config.namespace)
        while time.monotonic() < deadline:
            if set(self.actors) <= set(reader.live_nodes()):
                return
            time.sleep(0.1)
        raise TimeoutError("nodes did not register in Redis in time")

    def _write_state(self) -> None:
        path = state_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        # 0600: the Redis URL carries its password (`pdserve status` reads it from here).
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an older file keeps its mode through O_CREAT
        with os.fdopen(fd, "w") as f:
            json.dump({
                "grpc": self.address, "http": self.http_address, "redis_url": self.redis_url,
                "dashboard": self.dashboard_url, "namespace": self.config.namespace, "nodes": self.node_addresses,
                "pid": os.getpid(), "tls_ca": self.tls.ca_file if self.tls else None,
            }, f)

    @property
    def address(self) -> str | None:
        return self.router.address if self.router is not None else None

    @property
    def http_address(self) -> str | None:
        return self.router.http_address if self.router is not None else None

    # ------------------------------------------------------------------ tear-down
    def stop(self) -> None:
        if self.pools is not None:
            self.pools.stop()
            self.pools = None
        for proc in self.router_procs:  # SIGTERM: each drains as the first one does
            proc.terminate()
        if self.router is not None:
            self.router.drain(self.config.drain_timeout_s)
            self.router = None
        for proc in self.router_procs:
            proc.stop(timeout_s=self.config.drain_timeout_s + 5.0)
            proc.cleanup()
        self.router_procs.clear()
        if self._ray_started:
            import ray

            for a in self.actors.values():
                try:
                    # The router is gone: what a node still holds is orphaned, so a short drain.
                    ray.get(a.stop.remote(drain_timeout_s=2.0), timeout=10)
                except Exception as e:  # a dead actor has nothing to stop; note it and go on
                    self.progress(f"node stop: {type(e).__name__}")
                ray.kill(a, no_restart=True)
            self.actors.clear()
            ray.shutdown()
            self._ray_started = False
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._tls_dir is not None:
            shutil.rmtree(self._tls_dir, ignore_errors=True)
            self._tls_dir = None
        path = state_file()
        if path.exists():
            try:
                if json.loads(path.read_text()).get("pid") == os.getpid():
                    path.unlink()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_demo(address: str, prompt: str, tls=None, api_key: str | None = None) -> None:
    """Stream one answer through the router with the client SDK, as a user would."""
    import sys

    import pdserve

    t0 = time.perf_counter()
    sdk_tls = pdserve.TLS(root_certificates=tls.ca_file) if tls is not None else None
    with pdserve.Client(address, timeout=300, tls=sdk_tls, api_key=api_key) as client:
        stream = client.generate([{"role": "user", "content": prompt}], max_tokens=256, temperature=0.0)
        print(f"> {prompt}", flush=True)
        for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        done = stream.completion
    print(flush=True)
    if done is not None:
        t = done.timings
        print(f"[{len(done.token_ids)} tokens in {time.perf_counter() - t0:.2f}s; prefill node "
              f"{t.prefill_s * 1000:.0f} ms, KV transfer {t.transfer_s * 1000:.0f} ms, first token "
              f"{t.first_token_s * 1000:.0f} ms; prompt {done.usage.prompt_tokens} tokens, "
              f"{done.usage.cached_prompt_tokens} cached]", file=sys.stderr, flush=True)


def dashboard_login(environ: Mapping[str, str], home: Path) -> str | None:
    """Where the token Ray's dashboard asks for comes from, in Ray's own order ($RAY_AUTH_TOKEN,
    then the file $RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token, which ray.init writes when none
    exists); None when Ray's token authentication is off. Never the token itself."""
    if environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return None
    if environ.get("RAY_AUTH_TOKEN"):
        return "$RAY_AUTH_TOKEN"
    return environ.get("RAY_AUTH_TOKEN_PATH") or str(home / ".ray" / "auth_token")


def ready_line(cluster: LocalCluster, environ: Mapping[str, str], home: Path) -> str:
    """The one line scripts wait for: ``key=value`` fields, new ones only ever appended."""
    http = f" http={cluster.http_address}" if cluster.http_address else ""
    ca = f" tls_ca={cluster.tls.ca_file}" if cluster.tls else ""
    login = dashboard_login(environ, home) if cluster.dashboard_url else None
    token = f" dashboard_token={login}" if login else ""
    return f"pdserve ready grpc={cluster.address}{http} dashboard={cluster.dashboard_url}{ca}{token}"


def run_up(config: ClusterConfig, progress: Callable[[str], None], demo_prompt: str | None = None) -> int:
    """Foreground `pdserve up`: ready line, then wait for Ctrl-C / SIGTERM."""
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    cluster = LocalCluster(config, progress)
    try:
        cluster.start()
        # After ray.init: Ray's core installs its own SIGTERM handler, which would end this
        # process without tearing anything down.
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        print(ready_line(cluster, os.environ, Path.home()), flush=True)
        login = dashboard_login(os.environ, Path.home()) if cluster.dashboard_url else None
        if login:  # a newcomer who opens the URL meets "Authentication Token Required"
            progress(f"the dashboard {cluster.dashboard_url} asks for Ray's token: paste what `ray get-auth-token` "
                     f"prints (it reads {login})")
        if demo_prompt:
            run_demo(cluster.address, demo_prompt, cluster.tls, config.api_keys[0] if config.api_keys else None)
            progress(f"serving on {cluster.address}; try `pdserve generate --url {cluster.address} \"...\"`, "
                     f"`pdserve status`; Ctrl-C stops everything")
        while not stop.wait(0.5):
            pass
        progress("shutting down")
    finally:
        cluster.stop()
    return 0
