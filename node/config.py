"""Frozen configuration of one serving node (prefill or decode role).

Torch-free (``engine.config`` is plain data) so that launchers, the CLI and Ray drivers can
build it without loading the engine (``pdserve up`` builds one per node from its flags); the
engine's own settings stay in the nested ``EngineConfig``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.config import EngineConfig
from kv_index.nodes import Role
from security.tls import TlsFiles, tls_files
from settings.flags import negative_is_none, setting
from settings.shared import drain_timeout


@dataclass(frozen=True, slots=True)
class NodeConfig:
    node_id: str
    role: Role
    redis_url: str = field(repr=False)  # may hold the Redis password: never in a repr
    # the address the node binds; "0.0.0.0" / "::" = every interface
    host: str = setting("127.0.0.1", flag="--host", help="the address nodes bind (they register where they run)")
    # 0 = pick a free port (the bound port is what the node registers)
    grpc_port: int = setting(0, flag="--grpc-port", help="each node's gRPC port (0: a free one)")
    # The host other processes reach this node at: registered in the index with the bound ports.
    # None = ``host``; a node bound to every interface must be given one (a node actor fills it
    # in from its pod's or Ray node's address: node/actor.py).
    advertise_host: str | None = None
    # The gRPC port registered instead of the bound one, for a node reached through a forwarder
    # (a NAT, or the loopback proxy of `pdserve chaos --scenario partition`); None = the bound port.
    advertise_grpc_port: int | None = None
    # Redis key prefix; clusters sharing one Redis use different ones
    namespace: str = setting("pdserve", flag="--namespace", help="Redis key prefix and Ray namespace of the actors")
    # The node's registry entry expires lease_s after its last heartbeat: a dead node stops
    # receiving work within lease_s. heartbeat_s must be well below it.
    lease_s: float = setting(3.0, flag="--lease-s")
    heartbeat_s: float = 0.5
    # Redis clients (kv_index/client.py): seconds to connect and to wait for each reply. Only the
    # node's publisher thread waits on them, never the engine or a gRPC call; the reply bound
    # must cover the node's full resync of its block snapshot (one script call: 100k blocks
    # took 1.4-2.2 s on a loaded 2-core machine).
    redis_connect_timeout_s: float = setting(1.0, flag="--redis-connect-timeout", help="seconds a node waits to open "
                                             "a Redis connection")
    redis_timeout_s: float = setting(5.0, flag="--redis-timeout", help="seconds a node's index thread waits for a "
                                     "Redis reply (heartbeats, block events); it must cover a full resync of the "
                                     "node's blocks")
    # Decode role: seconds a KV reservation waits for its PushBlocks, and again after each
    # completed push for the Decode call, before its blocks are released.
    reservation_lease_s: float = 10.0
    # Decode role: load the model's tokenizer for text deltas and stop strings. Prefill nodes
    # never detokenize (the decode node streams the text), so they skip it.
    load_tokenizer: bool = True
    # gRPC worker threads: each Decode stream holds one for its whole duration.
    grpc_workers: int = 128
    # Backpressure (node/admission.py). Long RPCs (Decode, Prefill, PushBlocks) in flight at
    # once; beyond it RESOURCE_EXHAUSTED with a retry hint. None = grpc_workers less a quarter
    # of them, at most 8: those stay free for control calls (abort, release, renew, health).
    max_streams: int | None = None
    # Requests waiting in the engine for a slot in its running batch; a new request beyond it is
    # refused (RESOURCE_EXHAUSTED + retry hint) instead of queueing without bound.
    max_waiting: int = 64
    # RPCs the gRPC server holds at once, running or queued for a thread (grpc's
    # maximum_concurrent_rpcs); None = 2 x grpc_workers.
    max_concurrent_rpcs: int | None = None
    # SIGTERM / stop: seconds a draining node waits for its in-flight requests before it stops
    # (it takes no new ones, reports NOT_SERVING and is skipped by routers meanwhile).
    drain_timeout_s: float = drain_timeout(
        "seconds a node stopped (SIGTERM, scale-down) finishes its requests before it exits")
    # Engine steps that fail in a row before the node is unhealthy: it reports NOT_SERVING,
    # leaves the index, stops its engine and (as a Ray actor) exits to be restarted (0: never).
    # Each failed step fails only its own requests, which the router moves to another node.
    max_step_failures: int = setting(3, flag="--max-step-failures", help="engine steps failing in a row before a node "
                                     "turns unhealthy, leaves the index and restarts (0: never)")
    # Failed lives in a row (a start that raised or died, or unhealthy before one good step)
    # after which the node actor is not restarted and stays down, its reason recorded for
    # `pdserve status`; each retry waits longer (node/health.py, StartPolicy).
    max_start_failures: int = setting(3, flag="--max-start-failures", help="failed starts in a row (with a growing "
                                      "wait between them) before a node stays down")
    # Prometheus /metrics of this node on host:metrics_port (0 = a free port, registered in the
    # index as the node's metrics address; None = no metrics endpoint).
    metrics_port: int | None = setting(0, flag="--metrics-port", to_field=negative_is_none,
                                   help="each node's /metrics port (0: a free one, -1: none)")
    # OTLP/gRPC collector for traces (e.g. "http://otel-collector:4317"); None = the standard
    # OTEL_EXPORTER_OTLP_ENDPOINT variable if set, else tracing off.
    otlp_endpoint: str | None = setting(None, flag="--otlp-endpoint")
    # The model's name as clients and the router know it (the metrics' model_name label, so node
    # and router series join); None = engine.model, which may be a local path.
    served_model_name: str | None = setting(None, flag="--served-model-name", help="the model's name as the router "
                                            "serves it (the metrics' model_name; default: --model)")
    # Decode role: port of the raw TCP KV data stream beside gRPC (kv_transfer/tcp_transport.py),
    # advertised as tcp://host:port (0 = a free port, None = gRPC only). Plaintext: a node with
    # TLS configured does not open it, so its KV moves over the TLS-protected gRPC port.
    kv_data_port: int | None = setting(0, flag="--kv-data-port", to_field=negative_is_none, help="each decode node's "
                                       "raw KV data port beside gRPC (0: a free one, -1: none; off with TLS)")
    # Also move KV over torch.distributed process groups (gloo), one per kept data connection
    # (kv_transfer/dist_transport.py): the node advertises dist://host:port before tcp:// and
    # sends over dist to receivers that advertise it. Off by default: on CPU it is slower than
    # the raw TCP stream (docs/cluster.md). Needs the data port; never with TLS (plaintext).
    kv_dist: bool = setting(False, flag="--kv-dist", help="nodes also receive KV over torch.distributed process "
                            "groups on their data port (gloo; slower than the raw TCP stream on CPU: docs/cluster.md; "
                            "off with TLS)")
    # Prefill role: send each layer of each finished prefill chunk while the later ones compute
    # (layer-wise streaming, prefill_node/kv_streamer.py); False = push all the KV once the
    # prefill finished.
    kv_streaming: bool = setting(True, flag="--no-kv-streaming", help="prefill nodes push a request's KV once its "
                                 "prefill finished instead of layer by layer while it computes")
    # CPU cores this node's process may run on (os.sched_setaffinity), None = any. Benchmarks
    # pin each node to its own core so that layouts compare on the same cores.
    cpu_affinity: tuple[int, ...] | None = None
    # Mutual TLS between cluster members (docs/security.md): this node's certificate and key,
    # and the CA that signs every member; its gRPC port then admits only callers holding such
    # a certificate, and it dials peers with its own. All None: plaintext.
    tls_cert_file: str | None = setting(None, flag="--tls-cert-file", help="each node's certificate (PEM; mutual TLS "
                                        "between members)")
    tls_key_file: str | None = setting(None, flag="--tls-key-file", help="its private key (PEM)")
    tls_ca_file: str | None = setting(None, flag="--tls-ca-file", help="the CA that signs every cluster member (PEM)")
    # The name peers' certificates are verified against instead of the address dialled.
    tls_server_name: str | None = setting(None, flag="--tls-server-name", help="verify peers' certificates against "
                                          "this name instead of their address")
    # The secret every node of the cluster shares (security/cluster_token.py): without TLS, a
    # prefix fetch's holder and fetching node prove with it that both belong to the cluster
    # (docs/security.md). Read where the server is built, like the TLS files. None: the fetch
    # link trusts the registry alone.
    cluster_token_file: str | None = setting(None, flag="--cluster-token-file", help="a file holding the secret "
                                             "every node shares (at least 32 characters): authenticates prefix "
                                             "fetches between nodes without TLS")
    # Ranks (CPU processes on a gloo group) this node's engine runs on, each with 1/N of the
    # attention and KV heads and of the MLP (engine/parallel/, docs/engine.md). It must divide
    # the model's heads (checked when the engine starts, the reason recorded by the node actor).
    # 1 = one process. Not with speculative decoding or KV tiers yet.
    tensor_parallel: int = 1
    # The engine's per-step token budget while this node serves the prefill role; None = the
    # engine's own (``engine.scheduler.max_num_batched_tokens``), which every other role runs.
    # A node whose role may change runs one engine: the decode role's budget stays short so a
    # prompt chunk beside decodes stalls them little, while a prefill node has no decodes to
    # stall and prefills faster in longer chunks (SmolLM2-135M on one core of the dev VM: 3.4-3.5
    # ms a prompt token at 512 against 3.8 at 256). Set on the engine when a role's server is
    # built (node/server.py), so a live role switch changes it.
    prefill_step_tokens: int | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        try:  # a plain string from a flag or a values file names the role too
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            raise ValueError(f"role must be one of {[r.value for r in Role]}, got {self.role!r}") from None
        if not self.node_id:
            raise ValueError("node_id must be non-empty")
        if not 0 < self.heartbeat_s < self.lease_s:
            raise ValueError(
                f"need 0 < heartbeat_s < lease_s, got heartbeat_s={self.heartbeat_s} lease_s={self.lease_s}"
            )
        for name in ("redis_connect_timeout_s", "redis_timeout_s"):
            v = getattr(self, name)
            if not (0 < v < float("inf")):  # NaN fails too
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {v}")
        if self.advertise_host is not None and is_wildcard_host(self.advertise_host):
            raise ValueError(f"advertise_host must be an address others can reach, got {self.advertise_host!r}")
        if self.advertise_grpc_port is not None and not 0 < self.advertise_grpc_port < 65536:
            raise ValueError(f"advertise_grpc_port must be in [1, 65535] or None, got {self.advertise_grpc_port}")
        if not 0 <= self.grpc_port < 65536:
            raise ValueError(f"grpc_port must be in [0, 65535], got {self.grpc_port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535] or None, got {self.metrics_port}")
        if self.kv_data_port is not None and not 0 <= self.kv_data_port < 65536:
            raise ValueError(f"kv_data_port must be in [0, 65535] or None, got {self.kv_data_port}")
        if self.reservation_lease_s <= 0:
            raise ValueError(f"reservation_lease_s must be > 0, got {self.reservation_lease_s}")
        if self.grpc_workers < 2:
            raise ValueError(f"grpc_workers must be >= 2, got {self.grpc_workers}")
        if self.max_streams is not None and not 1 <= self.max_streams <= self.grpc_workers - 1:
            raise ValueError(f"max_streams must be in [1, grpc_workers - 1 = {self.grpc_workers - 1}] "
                             f"(a thread stays free for control calls), got {self.max_streams}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_concurrent_rpcs is not None and self.max_concurrent_rpcs < self.grpc_workers:
            raise ValueError(f"max_concurrent_rpcs must be >= grpc_workers ({self.grpc_workers}), "
                             f"got {self.max_concurrent_rpcs}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.max_step_failures < 0:
            raise ValueError(f"max_step_failures must be >= 0 (0: never unhealthy), got {self.max_step_failures}")
        if self.max_start_failures < 1:
            raise ValueError(f"max_start_failures must be >= 1, got {self.max_start_failures}")
        if self.prefill_step_tokens is not None and self.prefill_step_tokens < 1:
            raise ValueError(f"prefill_step_tokens must be >= 1 or None, got {self.prefill_step_tokens}")
        self._check_tensor_parallel()
        tls = self.tls
        if tls is not None and not tls.mutual:
            raise ValueError("node TLS is mutual: give tls_cert_file, tls_key_file and tls_ca_file together")

    def _check_tensor_parallel(self) -> None:
        # What engine/parallel/executor.py refuses at start, said here so a flag combination
        # fails before a node is spawned, naming the flags.
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.tensor_parallel == 1:
            return
        if self.engine.speculative.enabled:
            raise ValueError(f"speculative decoding is not supported with tensor parallelism yet: node "
                             f"{self.node_id} has tensor_parallel={self.tensor_parallel}; turn speculation off "
                             "(--spec-method off) or use --tensor-parallel 1")
        if self.engine.cache.host_cache_mib or self.engine.cache.disk_cache_dir:
            raise ValueError(f"KV tiers (host / disk cache) are not supported with tensor parallelism yet: node "
                             f"{self.node_id} has tensor_parallel={self.tensor_parallel}")

    def step_tokens(self, role: Role) -> int:
        """The engine's per-step token budget while serving ``role``."""
        if Role(role) is Role.PREFILL and self.prefill_step_tokens is not None:
            return self.prefill_step_tokens
        return self.engine.scheduler.max_num_batched_tokens

    @property
    def tls(self) -> TlsFiles | None:
        return tls_files(self.tls_cert_file, self.tls_key_file, self.tls_ca_file, self.tls_server_name)

    @property
    def stream_limit(self) -> int:
        """Long RPCs in flight at once (``max_streams`` or its default)."""
        if self.max_streams is not None:
            return self.max_streams
        return self.grpc_workers - max(1, min(8, self.grpc_workers // 4))

    @property
    def rpc_limit(self) -> int:
        """RPCs the gRPC server holds at once (``max_concurrent_rpcs`` or its default)."""
        return self.max_concurrent_rpcs if self.max_concurrent_rpcs is not None else 2 * self.grpc_workers

    @property
    def advertised_host(self) -> str | None:
        """The host this node registers: ``advertise_host``, else the bound ``host`` unless that
        is every interface (None: nothing routable is known)."""
        if self.advertise_host is not None:
            return self.advertise_host
        return None if is_wildcard_host(self.host) else self.host


def is_wildcard_host(host: str) -> bool:
    """Whether binding ``host`` means every interface (not an address a peer can dial)."""
    return host in ("", "0.0.0.0", "::", "[::]")


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def pool_resource(role: Role) -> str:
    """The Ray custom resource of a role's pool: a Ray node joins the prefill pool by offering
    ``{"prefill_pool": k}`` (k node actors fit on it)."""
    return f"{Role(role).value}_pool"


def ray_actor_options(
    config: NodeConfig, *, gpu: bool = False, accelerator_type: str | None = None, num_cpus: float = 1,
    detached: bool = False, extra_resources: Mapping[str, float] | None = None,
) -> dict:
    """``.options(...)`` for a node actor (plain dict, so this module stays Ray-free).

    Named after the node (it shows up by name on the dashboard and ``ray.get_actor`` finds it),
    pinned to its role's pool, restarted by Ray whenever its process dies; method calls
    (address, ready, stats) are idempotent reads, so a few are retried across a restart.
    ``max_restarts`` stays -1: a finite one would count every restart of the node's whole life
    (three OOM kills in a month would end it), and Ray neither waits between restarts nor
    restarts an actor whose constructor raised. The crash-loop bound is the actor's own
    (node/start_guard.py): ``max_start_failures`` failed lives in a row, with a back-off. ``detached``: the actor
    outlives the driver that made it (``pdserve nodes`` on a long-lived Ray cluster). A
    tensor-parallel node (``config.tensor_parallel`` N > 1) asks for N GPUs, or at least N CPUs.
    ``extra_resources``: custom resources it needs besides its pool's unit (a host's own resource
    pins a pool, or one node, to that host: `pdserve nodes --decode-ray-resource`).
    """
    options: dict = {
        "name": config.node_id,
        "resources": {**(extra_resources or {}), pool_resource(config.role): 1},
        "max_restarts": -1,
        "max_task_retries": 3,
        "num_cpus": num_cpus,
    }
    if detached:
        options["lifetime"] = "detached"
    if config.tensor_parallel > 1 and not gpu:
        # One rank per CPU: the worker ranks are the actor's child processes, Ray must count them.
        options["num_cpus"] = max(num_cpus, config.tensor_parallel)
    if gpu:
        options["num_gpus"] = config.tensor_parallel  # one device per rank
        if accelerator_type:
            options["accelerator_type"] = accelerator_type
    return options
