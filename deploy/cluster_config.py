"""The embedded cluster's configuration (`pdserve up`'s flags map onto it one to one): what
runs (nodes per role, their engine and threads), where (ports, Redis, namespace), and the
router's and nodes' settings it hands down; ``router_config`` derives the router's."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    engine: EngineConfig
    prefill_nodes: int = 1
    decode_nodes: int = 1
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int | None = 8000  # the router's HTTP API and /metrics (0 = a free port, None = none)
    otlp_endpoint: str | None = None  # traces to this OTLP collector (router and nodes)
    redis_url: str | None = None  # None: start a private redis-server
    dashboard_port: int = 8265
    namespace: str = "pdserve"
    short_prompt_tokens: int = 16
    lease_s: float = 3.0
    node_threads: int = 1  # torch threads per node: nodes share this machine's cores
    # Pin node i (prefill nodes first, then decode) to core i mod the core count: benchmarks
    # compare layouts on the same cores, one core per node.
    pin_cores: bool = False
    ready_timeout_s: float = 300.0
    # Ctrl-C / SIGTERM: the router finishes its in-flight requests for up to this long (new
    # ones refused), then the nodes and the rest stop.
    drain_timeout_s: float = 30.0
    tls: bool = False  # TLS on every gRPC hop and HTTPS, from a throwaway CA
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # keys clients must send; () = none
    # The router's fault handling (router/config.py): times a request whose node failed is placed
    # again, and the step-time factor past which a decode node is left out (0: never).
    max_migrations: int = 2
    straggler_factor: float = 3.0
    # How the router finds a node that failed quietly (router/liveness.py): a Decode stream's
    # progress deadline (factor x the node's step time within [floor, ceiling] seconds), and
    # the Prefill call's deadline (factor x the predicted time, at least the floor).
    decode_progress_factor: float = 10.0
    decode_progress_floor_s: float = 3.0
    decode_progress_ceiling_s: float = 30.0
    prefill_deadline_factor: float = 4.0
    prefill_deadline_floor_s: float = 10.0
    # The nodes' failure handling (node/config.py): failed engine steps in a row before a node
    # turns unhealthy and restarts, failed lives in a row before it stays down.
    max_step_failures: int = 3
    max_start_failures: int = 3
    # A prefill node fetches a prefix another node holds when that beats computing it
    # (router/config.py prefix_fetch).
    prefix_fetch: bool = True
    # Ranks of each node's engine by role (NodeConfig.tensor_parallel): CPU processes here.
    prefill_tensor_parallel: int = 1
    decode_tensor_parallel: int = 1
    # The engine's step budget while a node prefills for others (NodeConfig.prefill_step_tokens;
    # None: engine.scheduler.max_num_batched_tokens, as in the decode role).
    prefill_step_tokens: int | None = None

    # The router's planner (router/planner/config.py): off, advisory (reports only) or active;
    # its round and cool-down; the pool bounds it keeps (max None: the nodes started).
    planner: str = "advisory"
    planner_interval_s: float = 5.0
    planner_cooldown_s: float = 30.0
    min_prefill_nodes: int = 0
    max_prefill_nodes: int | None = None
    min_decode_nodes: int = 1
    max_decode_nodes: int | None = None
    planner_resize: bool = False  # pool sizes follow the planner too (needs both maxima)
    planner_window_s: float = 60.0  # seconds of finished requests a decision reads
    planner_burst_window_s: float = 10.0  # the last seconds whose rate counts when they are a burst
    planner_ttft_slo_factor: float = 5.0  # the SLO it scores layouts against (x unloaded TTFT, TPOT)
    planner_tpot_slo_factor: float = 2.0
    planner_slo_band: tuple[float, ...] = (1.0,)  # the SLO scaled by each, scored by the mean (headroom)
    planner_record: str | None = None  # a file for every round's signals and decision (JSON lines)

    def __post_init__(self) -> None:
        if self.prefill_nodes < 0 or self.decode_nodes < 1:
            raise ValueError("need at least one decode node and zero or more prefill nodes")
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
        if self.max_step_failures < 0 or self.max_start_failures < 1:
            raise ValueError(f"need max_step_failures >= 0 and max_start_failures >= 1, got "
                             f"{self.max_step_failures} and {self.max_start_failures}")

    @property
    def planner_config(self):
        from router.planner.config import planner_config

        return planner_config(self)


def router_config(cfg: ClusterConfig, **fields):
    """The RouterConfig of a local cluster: what ``cfg`` says, plus ``fields`` only bring-up
    knows (Redis URL, model directory and length, the members' TLS files)."""
    from router.config import RouterConfig

    return RouterConfig(
        host=cfg.host, port=cfg.grpc_port, namespace=cfg.namespace, short_prompt_tokens=cfg.short_prompt_tokens,
        http_port=cfg.http_port, ready_min_prefill=min(1, cfg.prefill_nodes), otlp_endpoint=cfg.otlp_endpoint,
        api_keys=cfg.api_keys, max_migrations=cfg.max_migrations, straggler_factor=cfg.straggler_factor,
        decode_progress_factor=cfg.decode_progress_factor, decode_progress_floor_s=cfg.decode_progress_floor_s,
        decode_progress_ceiling_s=cfg.decode_progress_ceiling_s, prefill_deadline_factor=cfg.prefill_deadline_factor,
        prefill_deadline_floor_s=cfg.prefill_deadline_floor_s, prefix_fetch=cfg.prefix_fetch,
        planner=cfg.planner_config, **fields)
