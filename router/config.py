"""Router configuration: one frozen dataclass; each flag of ``python -m router.server`` sets
the field of the same name (the rest keep their defaults)."""
from __future__ import annotations

from dataclasses import dataclass, field

from protos.conventions import MAX_MESSAGE_BYTES
from router.admission import SLO_CLASSES
from security.tls import TlsFiles, tls_files


@dataclass(frozen=True, slots=True)
class RouterConfig:
    redis_url: str = field(repr=False)  # may hold the Redis password: never in a repr
    model_name: str
    tokenizer_dir: str  # local HF tokenizer dir: tokenizer.json + tokenizer_config.json
    max_model_len: int  # prompt + output tokens of one request
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = pick a free port (RouterServer.address tells which)
    # OpenAI-compatible HTTP API, /metrics, /health and /ready on host:http_port (0 = a free
    # port, RouterServer.http_address tells which; None = no HTTP server).
    http_port: int | None = 8000
    # GET /ready needs at least this many live prefill nodes (and one decode node); 0 for a
    # cluster that prefills on its decode nodes only.
    ready_min_prefill: int = 1
    # OTLP/gRPC collector for traces; None = OTEL_EXPORTER_OTLP_ENDPOINT if set, else off.
    otlp_endpoint: str | None = None
    namespace: str = "pdserve"
    max_prompt_tokens: int | None = None  # None = max_model_len - 1
    max_tokens_limit: int | None = None  # None = no limit beyond max_model_len
    # Requests with n above this are not disaggregated: the decode node prefills them itself
    # (the prefill -> decode hand-off carries the KV of one sample).
    max_n: int = 1
    # Prompts shorter than this prefill on the decode node: a transfer would cost more than
    # recomputing them.
    short_prompt_tokens: int = 64
    node_refresh_s: float = 0.5
    prune_every_s: float = 10.0
    # Admission bound: requests beyond it get RESOURCE_EXHAUSTED with a retry hint.
    max_inflight: int = 256
    # SIGTERM: seconds the router keeps serving its in-flight requests (new ones get
    # UNAVAILABLE, health says NOT_SERVING) before it stops.
    drain_timeout_s: float = 30.0
    retry_after_ms: int = 200
    # Per-hop deadlines (seconds) for the node RPCs; the decode stream has none of its own
    # (it lasts as long as the client's deadline allows).
    reserve_timeout_s: float = 5.0
    prefill_timeout_s: float = 120.0
    control_timeout_s: float = 5.0
    max_message_bytes: int = MAX_MESSAGE_BYTES
    # Token ids accepted in token prompts and stop_token_ids; None = the tokenizer's vocab.
    vocab_size: int | None = None
    # EOS ids that end a request on its first token; None = from the tokenizer dir
    # (tokenizer_config's eos_token, config.json / generation_config.json eos_token_id).
    eos_token_ids: tuple[int, ...] | None = None
    # Weight of a node's queued/running tokens against its cached prefix tokens in placement
    # (policy "prefix_load" only).
    load_alpha: float = 0.5
    # "ttft": TtftPolicy (predicted time to first token, SLO admission); "prefix_load": the
    # first policy (cached tokens - alpha * queued tokens, no admission).
    policy: str = "ttft"
    # SLO class of requests that name none (GenerateRequest.slo_class UNSPECIFIED), a key of
    # router.admission.SLO_CLASSES. "relaxed" so slow hardware (CPU nodes) is not rejected by
    # budgets meant for accelerators; deployments on GPUs set "standard".
    default_slo_class: str = "relaxed"
    # TtftPolicy: weight of a request's compute seconds on top of its predicted TTFT. 4.0 was
    # chosen on the tuning split of the trace replay (docs/benchmarks.md, router section): the
    # live router runs the value the benchmark reports.
    compute_weight: float = 4.0
    # KV bytes per prompt token (transfer-time prior until transfers are measured); 0 = CostBook's default.
    kv_bytes_per_token: int = 0
    # Migration (router/migration.py): a request whose node fails is placed again at most this
    # many times (0 = never: the stream ends with the node's error, as before); the failed
    # node is left out of placement for exclude_failed_node_s; a migration waits up to
    # migration_wait_s for a live node (Ray restarting the only decode node, say).
    max_migrations: int = 2
    # Placement leaves out a decode node whose step time exceeds this many times the fastest
    # decode node's, or its own best recent one at a comparable batch (router/placement.py
    # without_stragglers); 0 = never.
    straggler_factor: float = 3.0
    exclude_failed_node_s: float = 10.0
    migration_wait_s: float = 30.0
    # While Redis is unreadable, keep placing on the nodes last read (by load, without the
    # index) for this long; then no node is known and requests get UNAVAILABLE.
    registry_outage_s: float = 30.0
    # TLS (docs/security.md). cert/key: what the client-facing gRPC and HTTP ports serve, and
    # what the router presents to nodes (mutual TLS); ca: the CA that signs the cluster's
    # members, trusted for nodes' certificates. All None: plaintext.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    # The name node certificates are verified against instead of the address dialled.
    tls_server_name: str | None = None
    # Clients must present a certificate signed by tls_ca_file (gRPC and HTTPS).
    tls_client_auth: bool = False
    # Keys accepted on every client route (gRPC metadata or HTTP ``Authorization: Bearer``);
    # empty = no key needed. Kept out of repr, so a logged config shows no secret.
    api_keys: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 1 <= self.effective_max_prompt_tokens < self.max_model_len:
            raise ValueError(
                f"max_prompt_tokens must be in [1, max_model_len={self.max_model_len}), "
                f"got {self.max_prompt_tokens}"
            )
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.policy not in ("ttft", "prefix_load"):
            raise ValueError(f"policy must be 'ttft' or 'prefix_load', got {self.policy!r}")
        if self.default_slo_class not in SLO_CLASSES:
            raise ValueError(f"default_slo_class must be one of {sorted(SLO_CLASSES)}, got {self.default_slo_class!r}")
        if self.max_migrations < 0 or self.exclude_failed_node_s < 0 or self.migration_wait_s < 0:
            raise ValueError("max_migrations, exclude_failed_node_s and migration_wait_s must be >= 0")
        if not self.straggler_factor >= 0 or self.straggler_factor == float("inf"):  # NaN fails >= 0
            raise ValueError(f"straggler_factor must be a finite number >= 0 (0: off), got {self.straggler_factor}")
        if self.node_refresh_s <= 0:
            raise ValueError(f"node_refresh_s must be > 0, got {self.node_refresh_s}")
        tls = self.tls  # validates the combination
        if tls is not None and tls.cert_file is None:
            raise ValueError("router TLS needs tls_cert_file and tls_key_file (it serves clients over TLS)")
        if self.tls_client_auth and (tls is None or tls.ca_file is None):
            raise ValueError("tls_client_auth needs tls_ca_file (the CA client certificates are checked against)")
        if any(not k or k != k.strip() for k in self.api_keys):
            raise ValueError("api_keys must be non-empty strings without surrounding whitespace")

    @property
    def tls(self) -> TlsFiles | None:
        return tls_files(self.tls_cert_file, self.tls_key_file, self.tls_ca_file, self.tls_server_name)

    @property
    def rpc_limit(self) -> int:
        """gRPC calls (and HTTP connections) the router holds at once: room for every admitted
        request, as many refusals in flight, and control calls."""
        return 2 * self.max_inflight + 64

    @property
    def effective_max_prompt_tokens(self) -> int:
        return self.max_prompt_tokens if self.max_prompt_tokens is not None else self.max_model_len - 1
