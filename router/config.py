"""Router configuration: one frozen dataclass whose fields declare the flags of
``python -m frontend.server`` (settings/flags.py: each flag sets its field; fields without one
keep their defaults)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from protos.conventions import MAX_MESSAGE_BYTES
from router.admission import SLO_CLASSES
from router.liveness import check_deadlines
from router.planner.config import PlannerConfig
from security.tls import TlsFiles, tls_files
from settings.flags import add_arguments, negative_is_none, setting
from settings.shared import drain_timeout

POLICIES = ("ttft", "prefix_load")
INDEX_LOOKUPS = ("local", "redis")
# Whose cached prompt blocks a request may reuse (router/prepare.py, docs/security.md "Tenants").
CACHE_SALT_SCOPES = ("key", "none")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    # may hold the Redis password: never in a repr
    redis_url: str = setting(repr=False, flag="--redis-url", help="its password, if any, from $PDSERVE_REDIS_PASSWORD")
    model_name: str = setting(flag="--model-name")
    # local HF tokenizer dir: tokenizer.json + tokenizer_config.json
    tokenizer_dir: str = setting(flag="--tokenizer-dir")
    max_model_len: int = setting(flag="--max-model-len")  # prompt + output tokens of one request
    host: str = setting("127.0.0.1", flag="--host")
    port: int = setting(50051, flag="--port")  # 0 = pick a free port (RouterServer.address tells which)
    # OpenAI-compatible HTTP API, /metrics, /health and /ready on host:http_port (0 = a free
    # port, RouterServer.http_address tells which; None = no HTTP server).
    http_port: int | None = setting(8000, flag="--http-port", to_field=negative_is_none,
                                     help="OpenAI-compatible HTTP API, /metrics, /health, /ready (-1: none)")
    # GET /ready needs at least this many live prefill nodes (and one decode node); 0 for a
    # cluster that prefills on its decode nodes only.
    ready_min_prefill: int = setting(1, flag="--ready-min-prefill", help="live prefill nodes GET /ready needs (0: a "
                                     "decode-only cluster)")
    # OTLP/gRPC collector for traces; None = OTEL_EXPORTER_OTLP_ENDPOINT if set, else off.
    otlp_endpoint: str | None = setting(None, flag="--otlp-endpoint", help="OTLP/gRPC collector for traces, e.g. "
                                        "http://127.0.0.1:4317 (default: $OTEL_EXPORTER_OTLP_ENDPOINT if set, else no "
                                        "tracing)")
    namespace: str = setting("pdserve", flag="--namespace")
    max_prompt_tokens: int | None = setting(None, flag="--max-prompt-tokens")  # None = max_model_len - 1
    max_tokens_limit: int | None = setting(None, flag="--max-tokens-limit")  # None = no limit beyond max_model_len
    # Requests with n above this are not disaggregated: the decode node prefills them itself
    # (the prefill -> decode hand-off carries the KV of one sample).
    max_n: int = 1
    # Prompts shorter than this prefill on the decode node: a transfer would cost more than
    # recomputing them.
    short_prompt_tokens: int = setting(64, flag="--short-prompt-tokens", help="prompts shorter than this prefill on "
                                       "the decode node")
    # A request whose uncached part on some decode node is shorter than this prefills there:
    # a follow-up turn whose conversation that node already holds pays no transfer (Dynamo's
    # max_local_prefill_length, which compares the prefill the request still needs). 0: off.
    local_prefill_uncached_tokens: int = setting(0, flag="--local-prefill-uncached-tokens",
                                                 help="prefill on a decode node that holds all but fewer than this "
                                                 "many of the prompt's tokens (0: off)")
    node_refresh_s: float = setting(0.5, flag="--node-refresh-s")
    # Several replicas on one port (`pdserve up --routers N`): each binds its gRPC and HTTP
    # ports with SO_REUSEPORT and the kernel spreads new connections over them; they share
    # their in-flight load through Redis (router/replicas.py). Off, a second router on the
    # port fails to bind (a mistake, not a replica).
    reuse_port: bool = setting(False, flag="--reuse-port", help="bind with SO_REUSEPORT: router replicas on one "
                               "port, sharing their load through Redis")
    # This replica's name in Redis ({ns}:routers; `pdserve status`): "" = host-pid-random.
    replica_id: str = setting("", flag="--replica-id", help="this router replica's name in Redis (default: "
                              "host-pid-random)")
    prune_every_s: float = 10.0
    # Admission bound: requests beyond it get RESOURCE_EXHAUSTED with a retry hint.
    max_inflight: int = setting(256, flag="--max-inflight")
    # SIGTERM: seconds the router keeps serving its in-flight requests (new ones get
    # UNAVAILABLE, health says NOT_SERVING) before it stops.
    drain_timeout_s: float = drain_timeout(
        "on SIGTERM, seconds to finish in-flight requests (new ones are refused) before exiting")
    retry_after_ms: int = 200
    # Per-hop deadlines (seconds) for the node RPCs. prefill_timeout_s is the Prefill call's
    # ceiling: its deadline is prefill_deadline_factor x the placement's predicted queue +
    # prefill + transfer, at least prefill_deadline_floor_s (router/liveness.py); past it the
    # decode node recomputes the prompt.
    reserve_timeout_s: float = 5.0
    prefill_timeout_s: float = 120.0
    control_timeout_s: float = 5.0
    prefill_deadline_factor: float = setting(4.0, flag="--prefill-deadline-factor", help="a Prefill call's deadline "
                                             "is this many times its predicted queue + prefill + transfer")
    prefill_deadline_floor_s: float = setting(10.0, flag="--prefill-deadline-floor", help="seconds: the shortest "
                                              "Prefill deadline (past it the decode node recomputes the prompt)")
    # A Decode stream has no deadline of its own (it lasts as long as the client's deadline
    # allows) but a progress deadline: no token and no heartbeat for decode_progress_factor x
    # the node's step time, clamped to [floor, ceiling] seconds (the ceiling while the node's
    # step time is unknown), and the node counts as failed for it: the request moves
    # (router/liveness.py). The floor bounds the detection of a frozen node (about 3 s on the
    # builtin model) and must exceed the longest single engine step (a chunk of a prompt
    # prefilled on the decode node) on a loaded host.
    decode_progress_factor: float = setting(10.0, flag="--decode-progress-factor", help="a Decode stream with no "
                                            "token and no heartbeat for this many times its node's step time (clamped "
                                            "to the floor and ceiling) moves to another node")
    decode_progress_floor_s: float = setting(3.0, flag="--decode-progress-floor", help="seconds: the shortest "
                                             "progress deadline (bounds the detection of a frozen decode node)")
    decode_progress_ceiling_s: float = setting(30.0, flag="--decode-progress-ceiling", help="seconds: the longest "
                                               "progress deadline (also while a node's step time is unknown)")
    max_message_bytes: int = MAX_MESSAGE_BYTES
    # The HTTP front's bounds (frontend/http_front.py). An HTTP body over max_body_bytes is 413;
    # None = what max_model_len tokens of the tokenizer's longest token can use, plus JSON
    # (frontend/http_budget.py body_limit_bytes; 1.2 MiB for SmolLM2's 8192 tokens).
    max_body_bytes: int | None = setting(None, flag="--max-body-bytes", help="HTTP bodies over this are 413 (default: "
                                         "what --max-model-len tokens can use)")
    # Body bytes held at once across HTTP requests (each until its response ends); a body
    # that would pass it is refused 429 + Retry-After before it is read.
    max_buffered_bytes: int = setting(128 << 20, flag="--max-buffered-bytes",
                                     help="HTTP body bytes held at once across requests; past it 429 + Retry-After")
    # A connection's request headers must be complete within this (slowloris), its body
    # within http_body_timeout_s of them; else 408.
    http_header_timeout_s: float = setting(20.0, flag="--http-header-timeout", help="seconds a connection may take to "
                                           "send a request's headers (else 408, closed)")
    http_body_timeout_s: float = setting(30.0, flag="--http-body-timeout", help="seconds a request may take to send "
                                         "its body after its headers (else 408)")
    # Open HTTP connections (idle ones too: each holds a descriptor and a read buffer); past it
    # a new one gets 429 + Retry-After before a byte is read (frontend/http_conn.py).
    http_max_connections: int = setting(1024, flag="--http-max-connections", help="open HTTP connections kept at "
                                        "once; past it a new one is answered 429 and closed")
    # A response its client has read nothing of for this long is dropped and its request
    # aborted (a client that stops reading would hold its slot and its decode stream forever).
    http_send_timeout_s: float = setting(30.0, flag="--http-send-timeout", help="seconds a response may wait on a "
                                         "client that reads none of it (then dropped, the request aborted)")
    # Structured-output compiles the router runs at once (router/structured.py); one more
    # waits at most compile_wait_s for a slot, then 429 + Retry-After. The compiled-grammar
    # cache keeps at most grammar_cache_bytes of constraint text (tokens/grammar.py).
    max_concurrent_compiles: int = setting(2, flag="--max-concurrent-compiles", help="grammar compiles the router "
                                           "runs at once; past them 429 after --compile-wait")
    compile_wait_s: float = setting(0.5, flag="--compile-wait", help="seconds a constraint waits for a compile slot")
    grammar_cache_bytes: int = setting(64 << 20, flag="--grammar-cache-bytes", help="bytes of constraint text the "
                                       "compiled-grammar cache keeps (refused ones too)")
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
    policy: str = setting("ttft", flag="--policy", choices=POLICIES)
    # SLO class of requests that name none (GenerateRequest.slo_class UNSPECIFIED), a key of
    # router.admission.SLO_CLASSES. "relaxed" so slow hardware (CPU nodes) is not rejected by
    # budgets meant for accelerators; deployments on GPUs set "standard".
    default_slo_class: str = setting("relaxed", flag="--default-slo-class")
    # TtftPolicy: weight of a request's remaining compute (at the cluster's typical node speed)
    # on top of its predicted TTFT. 2.0 was chosen for pdserve with prefix fetch on the tuning
    # split of the trace replay (docs/benchmarks.md, router section): the live router runs the
    # value the benchmark reports.
    compute_weight: float = 2.0
    # TtftPolicy: a prefill node may fetch the leading blocks another node (prefill or decode,
    # any tier) holds instead of computing them, when the cost model says the fetch is faster
    # (docs/cluster.md, "Prefix fetch"). A failed fetch is computed; False: never fetch.
    prefix_fetch: bool = setting(True, flag="--no-prefix-fetch", help="never have a prefill node fetch a prefix "
                                 "another node holds (policy ttft); it computes what it lacks")
    # KV bytes per prompt token (transfer-time prior until transfers are measured); 0 = CostBook's default.
    kv_bytes_per_token: int = 0
    # Migration (router/migration.py): a request whose node fails is placed again at most this
    # many times (0 = never: the stream ends with the node's error, as before); the failed
    # node is left out of placement for exclude_failed_node_s; a migration waits up to
    # migration_wait_s for a live node (Ray restarting the only decode node, say).
    max_migrations: int = setting(2, flag="--max-migrations", help="times a request whose node failed is placed again "
                                  "(0: the stream ends with the error)")
    # Placement leaves out a decode node whose step time exceeds this many times the fastest
    # decode node's, or its own best recent one at a comparable batch (router/placement.py
    # without_stragglers); 0 = never.
    straggler_factor: float = setting(3.0, flag="--straggler-factor", help="leave out a decode node whose step time "
                                      "is this many times the fastest one's or its own recent best (0: never)")
    exclude_failed_node_s: float = 10.0
    migration_wait_s: float = 30.0
    # While Redis is unreadable, keep placing on the nodes last read (by load, without the
    # index) for this long; then no node is known and requests get UNAVAILABLE. None: for as
    # long as the outage lasts (a node that died meanwhile is found out by its failed call).
    registry_outage_s: float | None = None
    # When Redis answers again, a node of the last view missing from the registry (its lease
    # ran out while Redis was frozen, or Redis restarted empty) is kept this long, time for
    # its next heartbeat to register it again.
    registry_settle_s: float = 5.0
    # Redis clients (kv_index/client.py): seconds to connect, and to wait for each reply on
    # the background thread (registry, step reports, pruning). See docs/cluster.md.
    redis_connect_timeout_s: float = setting(1.0, flag="--redis-connect-timeout", help="seconds to open a Redis "
                                             "connection")
    redis_timeout_s: float = setting(2.0, flag="--redis-timeout", help="seconds to wait for a Redis reply off the "
                                     "request path (node registry, step reports)")
    # The prefix lookup on the request path: the most a request waits for it, connect and
    # reply alike. After one failure lookups are skipped until Redis answers a probe
    # (router/index_guard.py), so a hung Redis costs at most this to the requests in flight.
    index_lookup_timeout_s: float = setting(0.5, flag="--index-lookup-timeout", help="most seconds a request waits "
                                            "for its prefix lookup in Redis; after a failure lookups are skipped "
                                            "(placement by load) until Redis answers again")
    # Where the prefix lookup reads the index: "local", this router's in-memory copy, fed by the
    # index's event stream (kv_index/local_index.py, event_feed.py): the same answer as Redis,
    # in process, a few milliseconds behind it at most (a stale entry costs a cache miss, never
    # a wrong answer), Redis asked until the copy has synced; "redis": one script call per lookup.
    index_lookup: str = setting("local", flag="--index-lookup", choices=INDEX_LOOKUPS,
                                help="local: look prefixes up in this router's copy of the index, fed by its "
                                "event stream (no round trip); redis: one Redis call per lookup")
    # TLS (docs/security.md). cert/key: what the client-facing gRPC and HTTP ports serve, and
    # what the router presents to nodes (mutual TLS); ca: the CA that signs the cluster's
    # members, trusted for nodes' certificates. All None: plaintext.
    tls_cert_file: str | None = setting(None, flag="--tls-cert-file", help="serve gRPC and HTTPS with this "
                                        "certificate (PEM); also shown to nodes")
    tls_key_file: str | None = setting(None, flag="--tls-key-file", help="the certificate's private key (PEM)")
    tls_ca_file: str | None = setting(None, flag="--tls-ca-file", help="the CA that signs the cluster's members "
                                      "(nodes' certificates)")
    # The name node certificates are verified against instead of the address dialled.
    tls_server_name: str | None = setting(None, flag="--tls-server-name", help="verify node certificates against this "
                                          "name, not the address")
    # Clients must present a certificate signed by tls_ca_file (gRPC and HTTPS).
    tls_client_auth: bool = setting(False, flag="--tls-client-auth", help="clients must present a certificate signed "
                                    "by --tls-ca-file")
    # Keys accepted on every client route (gRPC metadata or HTTP ``Authorization: Bearer``);
    # empty = no key needed. Kept out of repr, so a logged config shows no secret.
    api_keys: tuple[str, ...] = setting((), repr=False, flag="--api-key", flag_default=None, action="append", type=None,
                                        metavar="KEY", help="a key clients must send (repeatable); default "
                                        "$PDSERVE_API_KEY (comma-separated), which keeps it out of process listings")
    # "key": with API keys on, every request's blocks are salted by its key, so two keys never
    # share cached blocks nor learn (cached_prompt_tokens, timing) what the other's prompts were;
    # "none": keys share the cache, only a request's own cache_salt separates it. Without API
    # keys there is no tenant to tell apart: "key" salts nothing more.
    cache_salt_scope: str = setting("key", flag="--cache-salt-scope", choices=CACHE_SALT_SCOPES,
                                    help="key: each API key's requests reuse only that key's cached prompt blocks "
                                    "(default); none: keys share them (a request's cache_salt still separates)")
    # The planner (router/planner/): roles, the short-prompt threshold and pool sizes from the
    # measured load; one router leads (a lease in Redis), the others follow its plan.
    planner: PlannerConfig = PlannerConfig()

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
        if self.local_prefill_uncached_tokens < 0:
            raise ValueError(f"local_prefill_uncached_tokens must be >= 0 (0: off), got "
                             f"{self.local_prefill_uncached_tokens}")
        if self.index_lookup not in INDEX_LOOKUPS:
            raise ValueError(f"index_lookup must be 'local' or 'redis', got {self.index_lookup!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be 'ttft' or 'prefix_load', got {self.policy!r}")
        if self.default_slo_class not in SLO_CLASSES:
            raise ValueError(f"default_slo_class must be one of {sorted(SLO_CLASSES)}, got {self.default_slo_class!r}")
        if self.max_migrations < 0 or self.exclude_failed_node_s < 0 or self.migration_wait_s < 0:
            raise ValueError("max_migrations, exclude_failed_node_s and migration_wait_s must be >= 0")
        if not self.straggler_factor >= 0 or self.straggler_factor == float("inf"):  # NaN fails >= 0
            raise ValueError(f"straggler_factor must be a finite number >= 0 (0: off), got {self.straggler_factor}")
        if self.max_body_bytes is not None and self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1 (or None: from the context), got {self.max_body_bytes}")
        if self.max_body_bytes is not None and self.max_buffered_bytes < self.max_body_bytes:
            raise ValueError(f"max_buffered_bytes ({self.max_buffered_bytes}) must hold one body of max_body_bytes "
                             f"({self.max_body_bytes})")
        if not (self.http_header_timeout_s > 0 and self.http_body_timeout_s > 0 and self.http_send_timeout_s > 0):
            raise ValueError("http_header_timeout_s, http_body_timeout_s and http_send_timeout_s must be > 0")
        if self.http_max_connections < 1 or self.max_concurrent_compiles < 1 or self.grammar_cache_bytes < 1:
            raise ValueError("http_max_connections, max_concurrent_compiles and grammar_cache_bytes must be >= 1")
        if not self.compile_wait_s >= 0:  # NaN fails too
            raise ValueError(f"compile_wait_s must be >= 0, got {self.compile_wait_s}")
        if self.node_refresh_s <= 0:
            raise ValueError(f"node_refresh_s must be > 0, got {self.node_refresh_s}")
        self._check_deadlines()
        for name in ("redis_connect_timeout_s", "redis_timeout_s", "index_lookup_timeout_s"):
            v = getattr(self, name)
            if not (0 < v < float("inf")):  # NaN fails too
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {v}")
        if self.registry_settle_s < 0:
            raise ValueError(f"registry_settle_s must be >= 0, got {self.registry_settle_s}")
        tls = self.tls  # validates the combination
        if tls is not None and tls.cert_file is None:
            raise ValueError("router TLS needs tls_cert_file and tls_key_file (it serves clients over TLS)")
        if self.tls_client_auth and (tls is None or tls.ca_file is None):
            raise ValueError("tls_client_auth needs tls_ca_file (the CA client certificates are checked against)")
        if any(not k or k != k.strip() for k in self.api_keys):
            raise ValueError("api_keys must be non-empty strings without surrounding whitespace")
        if self.cache_salt_scope not in CACHE_SALT_SCOPES:
            raise ValueError(f"cache_salt_scope must be one of {list(CACHE_SALT_SCOPES)}, got {self.cache_salt_scope!r}")

    def _check_deadlines(self) -> None:
        check_deadlines(self.decode_progress_factor, self.decode_progress_floor_s, self.decode_progress_ceiling_s,
                        self.prefill_deadline_factor, self.prefill_deadline_floor_s, self.prefill_timeout_s)

    @property
    def tls(self) -> TlsFiles | None:
        return tls_files(self.tls_cert_file, self.tls_key_file, self.tls_ca_file, self.tls_server_name)

    @property
    def rpc_limit(self) -> int:
        """gRPC calls (and HTTP requests, frontend/http_front.py) the router holds at once: room
        for every admitted request, as many refusals in flight, and control calls."""
        return 2 * self.max_inflight + 64

    @property
    def effective_max_prompt_tokens(self) -> int:
        return self.max_prompt_tokens if self.max_prompt_tokens is not None else self.max_model_len - 1


# How the router gives up on a quiet node (router/liveness.py): flags of `pdserve up` too.
DEADLINE_FIELDS = ("decode_progress_factor", "decode_progress_floor_s", "decode_progress_ceiling_s",
                   "prefill_deadline_factor", "prefill_deadline_floor_s")
SECURITY_FIELDS = ("tls_cert_file", "tls_key_file", "tls_ca_file", "tls_server_name", "tls_client_auth", "api_keys")


def add_deadline_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``DEADLINE_FIELDS`` (``python -m frontend.server`` and ``pdserve up``)."""
    add_arguments(p, RouterConfig, DEADLINE_FIELDS)
