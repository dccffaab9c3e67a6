"""The embedded cluster's configuration: what runs (nodes per role, their engine and threads),
where (ports, Redis, namespace), and the router's and nodes' settings it hands down;
``router_config`` derives the router's. Its fields declare `pdserve up`'s flags
(settings/flags.py); a setting it hands down is the router's, planner's or node's own
declaration (``like``), not a second one."""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from node.config import NodeConfig
from router.config import RouterConfig
from router.planner.config import PlannerConfig, planner_config
from settings.flags import like, setting, shared_values
from settings.shared import drain_timeout


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    engine: EngineConfig
    prefill_nodes: int = setting(1, flag="--prefill-nodes")
    decode_nodes: int = setting(1, flag="--decode-nodes")
    host: str = "127.0.0.1"
    # The router's gRPC port (RouterConfig.port; a node's own is NodeConfig.grpc_port).
    grpc_port: int = setting(50051, flag="--grpc-port")
    # The router's HTTP API and /metrics (0 = a free port, None = none).
    http_port: int | None = like(RouterConfig, "http_port",
                                 help="the router's OpenAI-compatible HTTP API and /metrics (-1: none)")
    # Traces to this OTLP collector (router and nodes).
    otlp_endpoint: str | None = like(RouterConfig, "otlp_endpoint", help="export traces to this OTLP/gRPC collector "
                                     "(default: $OTEL_EXPORTER_OTLP_ENDPOINT, else off)")
    # Router replicas on the one port (SO_REUSEPORT; the kernel spreads the connections): one in
    # the launcher's process, the rest `python -m frontend.server` processes, all sharing their
    # in-flight load through Redis (router/replicas.py).
    routers: int = setting(1, flag="--routers", help="router replicas on the one gRPC and HTTP port, sharing "
                           "their load through Redis (default 1)")
    # None: a private redis-server
    redis_url: str | None = setting(None, flag="--redis-url", help="use this Redis instead of starting one "
                                    "(redis+cluster://HOST:PORT: a Redis Cluster)")
    # >0: start a private Redis Cluster of this many masters, a replica each (deploy/redis_cluster.py)
    redis_cluster: int = setting(0, flag="--redis-cluster", help="start a local Redis Cluster of N masters, "
                                 "a replica each, instead of one redis-server (0: one redis-server)")
    dashboard_port: int = setting(8265, flag="--dashboard-port")
    namespace: str = "pdserve"
    short_prompt_tokens: int = like(RouterConfig, "short_prompt_tokens", default=16)
    local_prefill_uncached_tokens: int = like(RouterConfig, "local_prefill_uncached_tokens")
    lease_s: float = 3.0  # the nodes' registry lease (NodeConfig.lease_s)
    # Torch threads per node: nodes share this machine's cores.
    node_threads: int = setting(1, flag="--node-threads", help="torch threads per node (per rank with tensor "
                                "parallelism)")
    # Pin node i (prefill nodes first, then decode) to core i mod the core count: benchmarks
    # compare layouts on the same cores, one core per node.
    pin_cores: bool = False
    ready_timeout_s: float = 300.0
    # Ctrl-C / SIGTERM: the router finishes its in-flight requests for up to this long (new
    # ones refused), then the nodes and the rest stop.
    drain_timeout_s: float = drain_timeout(
        "on Ctrl-C / SIGTERM, seconds to finish in-flight requests (new ones refused) before stopping")
    # TLS on every gRPC hop and HTTPS, from a throwaway CA.
    tls: bool = setting(False, flag="--tls", help="TLS on every gRPC hop (mutual between members) and HTTPS, from a "
                        "throwaway CA")
    api_keys: tuple[str, ...] = like(RouterConfig, "api_keys", help="clients must send this key (repeatable; default "
                                     "$PDSERVE_API_KEY, comma-separated)")  # () = none
    # Whether API keys share cached prompt blocks (router/prepare.py): "key" (default) keeps them apart.
    cache_salt_scope: str = like(RouterConfig, "cache_salt_scope")
    # The router's fault handling (router/config.py): times a request whose node failed is placed
    # again, and the step-time factor past which a decode node is left out (0: never).
    max_migrations: int = like(RouterConfig, "max_migrations")
    straggler_factor: float = like(RouterConfig, "straggler_factor")
    # How the router finds a node that failed quietly (router/liveness.py): a Decode stream's
    # progress deadline (factor x the node's step time within [floor, ceiling] seconds), and
    # the Prefill call's deadline (factor x the predicted time, at least the floor).
    decode_progress_factor: float = like(RouterConfig, "decode_progress_factor")
    decode_progress_floor_s: float = like(RouterConfig, "decode_progress_floor_s")
    decode_progress_ceiling_s: float = like(RouterConfig, "decode_progress_ceiling_s")
    prefill_deadline_factor: float = like(RouterConfig, "prefill_deadline_factor")
    prefill_deadline_floor_s: float = like(RouterConfig, "prefill_deadline_floor_s")
    # The nodes' failure handling (node/config.py): failed engine steps in a row before a node
    # turns unhealthy and restarts, failed lives in a row before it stays down.
    max_step_failures: int = like(NodeConfig, "max_step_failures")
    max_start_failures: int = like(NodeConfig, "max_start_failures")
    # A prefill node fetches a prefix another node holds when that beats computing it
    # (router/config.py prefix_fetch).
    prefix_fetch: bool = like(RouterConfig, "prefix_fetch", help="never have a prefill node fetch a prefix another "
                              "node holds; it computes what it lacks")
    # Ranks of each node's engine by role (NodeConfig.tensor_parallel): CPU processes here.
    prefill_tensor_parallel: int = 1
    decode_tensor_parallel: int = 1
    # The engine's step budget while a node prefills for others (NodeConfig.prefill_step_tokens;
    # None: engine.scheduler.max_num_batched_tokens, as in the decode role).
    prefill_step_tokens: int | None = None

    # The router's planner (router/planner/config.py), under its flags' dests: off, advisory
    # (reports only) or active; its round and cool-down; the pool bounds it keeps (max None: the
    # nodes started); ``planner_config`` is the PlannerConfig.
    planner: str = like(PlannerConfig, "mode")
    planner_interval_s: float = like(PlannerConfig, "interval_s")
    planner_cooldown_s: float = like(PlannerConfig, "cooldown_s")
    min_prefill_nodes: int = like(PlannerConfig, "min_prefill_nodes")
    max_prefill_nodes: int | None = like(PlannerConfig, "max_prefill_nodes")
    min_decode_nodes: int = like(PlannerConfig, "min_decode_nodes")
    max_decode_nodes: int | None = like(PlannerConfig, "max_decode_nodes")
    planner_resize: bool = like(PlannerConfig, "resize")  # pool sizes follow the planner too (needs both maxima)
    planner_window_s: float = like(PlannerConfig, "window_s")
    planner_burst_window_s: float = like(PlannerConfig, "burst_window_s")
    planner_ttft_slo_factor: float = like(PlannerConfig, "ttft_slo_factor")
    planner_tpot_slo_factor: float = like(PlannerConfig, "tpot_slo_factor")
    planner_slo_band: tuple[float, ...] = like(PlannerConfig, "slo_band")
    planner_record: str | None = like(PlannerConfig, "record")

    def __post_init__(self) -> None:
        if self.redis_cluster < 0 or (self.redis_cluster and self.redis_url):
            raise ValueError(f"redis_cluster must be >= 0 and is for a Redis this starts, not with redis_url "
                             f"(got {self.redis_cluster}, {self.redis_url!r})")
        if self.prefill_nodes < 0 or self.decode_nodes < 1:
            raise ValueError("need at least one decode node and zero or more prefill nodes")
        if self.engine.backend == "vllm" and (self.prefill_nodes or self.planner == "active"):
            raise ValueError("--engine vllm runs decode nodes that prefill their own prompts: use --prefill-nodes 0 "
                             "and no active planner (vLLM prefill nodes need the KV connector, issue 46 section 2)")
        _ = self.planner_config  # builds it: the planner's settings and bounds are refused here, before Ray starts
        for role, n, hi in (("prefill", self.prefill_nodes, self.max_prefill_nodes),
                            ("decode", self.decode_nodes, self.max_decode_nodes)):
            if hi is not None and n > hi:
                raise ValueError(f"{role}_nodes ({n}) is above max_{role}_nodes ({hi})")
        # Checked here too, so a bad value stops `pdserve up` before Ray and the nodes start.
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if not self.straggler_factor >= 0 or self.straggler_factor == float("inf"):  # NaN fails >= 0
            raise ValueError(f"straggler_factor must be a finite number >= 0 (0: off), got {self.straggler_factor}")
        from router.liveness import check_deadlines

        check_deadlines(self.decode_progress_factor, self.decode_progress_floor_s, self.decode_progress_ceiling_s,
                        # the Prefill ceiling is the router's prefill_timeout_s, checked when it starts
                        self.prefill_deadline_factor, self.prefill_deadline_floor_s, self.prefill_deadline_floor_s)
        if min(self.prefill_tensor_parallel, self.decode_tensor_parallel) < 1:
            raise ValueError(f"tensor parallel sizes must be >= 1, got prefill {self.prefill_tensor_parallel}, "
                             f"decode {self.decode_tensor_parallel}")
        if self.prefill_step_tokens is not None and self.prefill_step_tokens < 1:
            raise ValueError(f"prefill_step_tokens must be >= 1 or None, got {self.prefill_step_tokens}")
        check_routers(self.routers, self.tls, self.api_keys)
        if self.max_step_failures < 0 or self.max_start_failures < 1:
            raise ValueError(f"need max_step_failures >= 0 and max_start_failures >= 1, got "
                             f"{self.max_step_failures} and {self.max_start_failures}")

    @property
    def planner_config(self) -> PlannerConfig:
        return planner_config(self)


def check_routers(routers: int, tls: bool, api_keys) -> None:
    """ValueError for a replica count `pdserve up` cannot run."""
    if routers < 1:
        raise ValueError(f"routers must be >= 1, got {routers}")
    if routers > 1 and (tls or api_keys):
        # The extra replicas are processes of their own: the throwaway CA's member key and the
        # API keys would have to reach them off their command line, which is not built yet.
        raise ValueError(f"--routers {routers} cannot be combined with {'--tls' if tls else '--api-key'}: the extra "
                         f"router replicas run as `python -m frontend.server` processes, which `pdserve up` does not "
                         f"hand TLS files or API keys; use --routers 1, or the Helm chart's router replicas")


# ClusterConfig fields a RouterConfig has under the same name but that are not the router's:
# ``planner`` is the planner's mode here (``planner_config`` is the router's PlannerConfig);
# the cluster's drain is run by the launcher, which passes it to ``RouterServer.drain``.
NOT_THE_ROUTERS = ("planner", "drain_timeout_s")


def router_config(cfg: ClusterConfig, **fields):
    """The RouterConfig of a local cluster: the settings ``cfg`` hands the router (its fields of
    the same name), plus ``fields`` only bring-up knows (Redis URL, model directory and length,
    the members' TLS files)."""
    return RouterConfig(**{**shared_values(cfg, RouterConfig, exclude=NOT_THE_ROUTERS),
                           "port": cfg.grpc_port, "ready_min_prefill": min(1, cfg.prefill_nodes),
                           "reuse_port": cfg.routers > 1,
                           "planner": cfg.planner_config, **fields})
