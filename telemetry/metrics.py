"""Prometheus metrics of the router and the nodes, named as vLLM users already chart them.

Every name starts with ``pdserve:`` and carries a ``model_name`` label; node metrics add
``role`` (prefill / decode) and ``node_id``. docs/observability.md says what each one means and
where it is measured.

Each process builds its metrics on a registry of its own (not prometheus_client's global one):
tests run a router and several nodes in one process, and two nodes must not share counters.

Counters that the engine already keeps (prefix-cache tokens, preemptions, speculative drafts)
are not mirrored into prometheus objects on every step: ``EngineCollector`` reads the engine's
cumulative figures at scrape time, so the engine loop pays nothing for metrics.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

PREFIX = "pdserve:"

# vLLM's buckets, so dashboards built for vLLM read ours unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


# The router's label values (router/placement.py Placement.kind, router/validation.py RouterError.reason).
DECISIONS = ("disaggregated", "disaggregated_fetch", "local")
# The rejections the orchestrator names itself (router/orchestrator.py); the others come from
# RouterError.reason.
REJECTED_DUPLICATE_ID, REJECTED_OVERLOADED, REJECTED_UNAVAILABLE = "duplicate_id", "overloaded", "unavailable"
REJECTIONS = ("invalid", "not_found", REJECTED_DUPLICATE_ID, REJECTED_OVERLOADED, "slo", REJECTED_UNAVAILABLE)
# Requests placed again after a node failed (router/migration.py): the decode stream broke and
# the request moved to another node, its prefill failed and was placed again, or it could not
# move (no migration left, no live node, n > 1) and ended with an error.
MIGRATION_DECODE_FAILED, MIGRATION_PREFILL_FAILED, MIGRATION_GAVE_UP = "decode_failed", "prefill_failed", "gave_up"
MIGRATIONS = (MIGRATION_DECODE_FAILED, MIGRATION_PREFILL_FAILED, MIGRATION_GAVE_UP)
# finished_reason values exported at 0 from the start: tokens/stop.py FinishReason's values
# (telemetry imports no first-party package), the router's "error" besides, and the prefill
# role's one reason, "prefilled" (its requests end once their KV is pushed).
ENGINE_FINISH_REASONS = ("stop", "length", "abort")
ROUTER_FINISH_REASONS = (*ENGINE_FINISH_REASONS, "error")
PREFILLED = "prefilled"
# How the router found out that a node failed for a request (router/liveness.py).
NODE_FAILURES = ("unavailable", "keepalive", "progress_deadline", "lease_lapsed", "step_error", "prefill_deadline")


def name(short: str) -> str:
    return PREFIX + short


class PoolMetrics:
    """``pdserve:pool_changes_total{role,action}``: node actors the pool controller added or
    removed (deploy/pool_controller.py); on the router's /metrics under `pdserve up`."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._changes = Counter(name("pool_changes_total"), "Node actors the pool controller added or removed.",
                                ["model_name", "role", "action"], registry=registry)
        self.model_name = model_name

    def changed(self, role: str, action: str) -> None:
        self._changes.labels(model_name=self.model_name, role=role, action=action).inc()


class RequestMetrics:
    """Per-request latencies and token counts, as seen by one process (the router sees what
    clients see; a node sees its own part of the request)."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self.labels = dict(labels)
        keys = list(self.labels)

        def hist(short, doc, buckets):
            return Histogram(name(short), doc, keys, buckets=buckets, registry=registry).labels(**self.labels)

        def counter(short, doc):
            return Counter(name(short), doc, keys, registry=registry).labels(**self.labels)

        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between two consecutive tokens of a sample; an "
                        "output carrying n tokens is n observations of its gap / n.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last sample's completion.",
                        REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time from arrival until the request's prefill "
                          "started.", REQUEST_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished samples.")
        self._success = Counter(name("request_success"), "Finished samples, by finish reason.",
                                [*keys, "finished_reason"], registry=registry)

    def success(self, finished_reason: str) -> None:
        self._success.labels(**self.labels, finished_reason=finished_reason).inc()

    def declare_reasons(self, finished_reasons) -> None:
        """Export these reasons at 0 before any request, so rate() over them starts at once."""
        for reason in finished_reasons:
            self._success.labels(**self.labels, finished_reason=reason)


class RouterMetrics:
    """The router's metrics; ``RouterMetrics(model)`` builds its own registry."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = {"model_name": model_name}
        self.requests = RequestMetrics(self.registry, labels)
        self.running = Gauge(name("num_requests_running"), "Requests in flight through this router.",
                             ["model_name"], registry=self.registry).labels(**labels)
        self._decisions = Counter(name("router_decisions"), "Placement decisions, by kind (disaggregated, "
                                  "local: prefilled on the decode node, ...).", ["model_name", "reason"],
                                  registry=self.registry)
        self._rejected = Counter(name("requests_rejected"), "Requests refused before any output, by reason "
                                 "(invalid, overloaded, slo, unavailable, not_found; the HTTP front's http_overloaded, "
                                 "body_too_large, body_budget, body_timeout).", ["model_name", "reason"],
                                 registry=self.registry)
        self._migrations = Counter(name("request_migrations"), "Requests placed again after a node failed, by "
                                   "reason (decode_failed, prefill_failed, gave_up).", ["model_name", "reason"],
                                   registry=self.registry)
        self._node_failures = Counter(name("router_node_failures_detected"), "Node failures the router detected "
                                      "on a request's call, by how (unavailable, keepalive, progress_deadline, "
                                      "lease_lapsed, step_error, prefill_deadline).", ["model_name", "reason"],
                                      registry=self.registry)
        self._planner = Counter(name("planner_decisions"), "Planner rounds of the leading router, by action (hold, "
                                "switch_roles, set_threshold, scale_up, scale_down) and reason (router/planner/).",
                                ["model_name", "action", "reason"], registry=self.registry)
        self._model = model_name
        # Exported at 0 from the start, so rate() and dashboards see every series at once.
        for reason in MIGRATIONS:
            self._migrations.labels(model_name=model_name, reason=reason)
        for reason in NODE_FAILURES:
            self._node_failures.labels(model_name=model_name, reason=reason)
        self.requests.declare_reasons(ROUTER_FINISH_REASONS)
        for reason in DECISIONS:
            self._decisions.labels(model_name=model_name, reason=reason)
        for reason in REJECTIONS:
            self._rejected.labels(model_name=model_name, reason=reason)

    def decision(self, reason: str) -> None:
        self._decisions.labels(model_name=self._model, reason=reason).inc()

    def planner_decision(self, action: str, reason: str) -> None:
        self._planner.labels(model_name=self._model, action=action, reason=reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(model_name=self._model, reason=reason).inc()

    def migrated(self, reason: str) -> None:
        self._migrations.labels(model_name=self._model, reason=reason).inc()

    def node_failure(self, reason: str) -> None:
        """One request's call found its node failed, and how (one of NODE_FAILURES)."""
        self._node_failures.labels(model_name=self._model, reason=reason).inc()

    def watch_index(self, freshness: Callable[[], Mapping[str, float]], accuracy: Callable[[], float | None]) -> None:
        """Export the index's freshness (per node) and accuracy, read at scrape time."""
        self.registry.register(_IndexCollector(self._model, freshness, accuracy))

    def watch_transfers(self, fits: Callable[[], Iterable]) -> None:
        """Export the router's fitted KV transfer cost per (src, dst, transport), read at scrape
        time. ``fits`` returns records with ``src``, ``dst``, ``transport``, ``bandwidth``,
        ``fixed_s``, ``current`` and ``exposed_factor`` (router/cost_model.py TransferFitView);
        duck-typed, since telemetry imports no router module."""
        self.registry.register(_TransferCollector(self._model, fits))

    def watch_degraded(self, degraded: Callable[[], bool], lookups: Callable[[], tuple[int, int]]) -> None:
        """Export whether the router places without the index (Redis failing), read at scrape
        time; ``lookups`` returns (failed, skipped) prefix lookups so far."""
        self.registry.register(_DegradedCollector(self._model, degraded, lookups))


class _DegradedCollector(Collector):
    def __init__(self, model: str, degraded, lookups) -> None:
        self.model, self.degraded, self.lookups = model, degraded, lookups

    def collect(self):
        g = GaugeMetricFamily(name("router_degraded"), "1 while the router places requests without the full "
                              "index (Redis unreadable or failing lookups; it still serves), else 0.",
                              labels=["model_name"])
        g.add_metric([self.model], 1.0 if self.degraded() else 0.0)
        yield g
        failed, skipped = self.lookups()
        f = CounterMetricFamily(name("index_lookup_failures"), "Prefix lookups in Redis that failed (timed out, "
                                "refused); the request was placed without the index.", labels=["model_name"])
        f.add_metric([self.model], failed)
        yield f
        k = CounterMetricFamily(name("index_lookups_skipped"), "Prefix lookups not made because Redis was "
                                "failing (the breaker was open); placed by load.", labels=["model_name"])
        k.add_metric([self.model], skipped)
        yield k


class _IndexCollector(Collector):
    def __init__(self, model: str, freshness, accuracy) -> None:
        self.model, self.freshness, self.accuracy = model, freshness, accuracy

    def collect(self):
        f = GaugeMetricFamily(name("index_freshness_seconds"), "Age of the newest block-event batch the index "
                              "applied, per node.", labels=["model_name", "node_id"])
        for node_id, age in sorted(self.freshness().items()):
            f.add_metric([self.model, node_id], age)
        yield f
        a = GaugeMetricFamily(name("index_accuracy"), "Fraction of disaggregated requests whose predicted cached "
                              "prompt tokens equalled those the prefill node reused.", labels=["model_name"])
        acc = self.accuracy()
        if acc is not None:
            a.add_metric([self.model], acc)
        yield a


class _TransferCollector(Collector):
    def __init__(self, model: str, fits) -> None:
        self.model, self.fits = model, fits

    def collect(self):
        keys = ["model_name", "src", "dst", "transport"]
        bw = GaugeMetricFamily(name("router_kv_bandwidth_bytes_per_second"), "KV transfer bandwidth the router "
                               "has fitted per (prefill, decode) pair and transport.", labels=keys)
        fixed = GaugeMetricFamily(name("router_kv_fixed_seconds"), "Fixed cost per KV push the router has "
                                  "fitted per (prefill, decode) pair and transport.", labels=keys)
        exposed = GaugeMetricFamily(name("router_kv_exposed_fraction"), "Expected share of a KV transfer that "
                                    "a request waits for after its prefill (below 1 when streamed layer by "
                                    "layer), per pair, for the transport the pair uses now.", labels=keys)
        for f in self.fits():
            labels = [self.model, f.src, f.dst, f.transport]
            bw.add_metric(labels, f.bandwidth)
            fixed.add_metric(labels, f.fixed_s)
            if f.current:
                exposed.add_metric(labels, f.exposed_factor)
        yield bw
        yield fixed
        yield exposed


# Why a prefix fetch ended as it did (PrefillResponse.fetch_outcome): "ok" and "held" reuse the
# prefix, every other outcome computes it instead.
FETCH_OUTCOMES = ("ok", "held", "failed", "timeout", "corrupt", "refused")


class FetchMetrics:
    """Prefix fetches of a node (node/prefix_fetch.py): the leading blocks of a prompt brought
    from the node that holds them instead of being computed."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        keys = list(labels)
        total = Counter(name("kv_fetch"), "Prefix fetches by outcome: ok (fetched), held (already here), or "
                        "computed instead: failed, timeout, corrupt, refused.", [*keys, "outcome"], registry=registry)
        self.outcomes = {o: total.labels(**labels, outcome=o) for o in FETCH_OUTCOMES}
        self.bytes = Counter(name("kv_fetch_bytes"), "KV bytes fetched from the nodes holding prefixes.", keys,
                             registry=registry).labels(**labels)
        self.seconds = Histogram(name("kv_fetch_seconds"), "Duration of one prefix fetch, reserve to registered, "
                                 "whatever its outcome.", keys, buckets=TRANSFER_BUCKETS,
                                 registry=registry).labels(**labels)

    def record(self, outcome: str, num_bytes: int, seconds: float) -> None:
        self.outcomes[outcome].inc()
        self.bytes.inc(num_bytes)
        self.seconds.observe(seconds)


class NodeMetrics:
    """A node's metrics. ``engine_stats`` returns the engine's cumulative figures (see
    ``EngineCollector``); the node's servers record requests and transfers directly."""

    def __init__(self, model_name: str, role: str, node_id: str,
                 engine_stats: Callable[[], Mapping] | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = {"model_name": model_name, "role": role, "node_id": node_id}
        self.labels = labels
        keys = list(labels)
        self.requests = RequestMetrics(self.registry, labels)
        # A prefill node's requests end once their KV is pushed (PREFILLED); a decode node's
        # samples end as the engine says (stop, length, abort).
        self.requests.declare_reasons((PREFILLED,) if role == "prefill" else ENGINE_FINISH_REASONS)
        self.transfer_bytes = Counter(name("kv_transfer_bytes"), "KV bytes sent (prefill) or received (decode).",
                                      keys, registry=self.registry).labels(**labels)
        self.transfer_seconds = Histogram(name("kv_transfer_seconds"), "Duration of one request's KV transfer.",
                                          keys, buckets=TRANSFER_BUCKETS, registry=self.registry).labels(**labels)
        self.transfer_failures = Counter(name("kv_transfer_failures"), "KV transfers that failed (the request "
                                         "was then recomputed).", keys, registry=self.registry).labels(**labels)
        self.fetch = FetchMetrics(self.registry, labels)
        # 0 once the node is unhealthy (failing engine steps, or its engine thread died): it left
        # the index; node/server.py sets it.
        self.healthy = Gauge(name("node_healthy"), "1 while the node's engine serves; 0 once it is unhealthy "
                             "(it left the index).", keys, registry=self.registry).labels(**labels)
        if engine_stats is not None:
            self.registry.register(EngineCollector(labels, engine_stats))

    def watch_dist(self, stats: Callable[[], Mapping]) -> None:
        """The dist transport's process groups at scrape time (``DistCollector``)."""
        self.registry.register(DistCollector(self.labels, stats))


class DistCollector(Collector):
    """A node's torch.distributed KV groups (kv_transfer/dist_group.py) from ``stats()``:
    ``{"send": (made, setup_s), "receive": (made, setup_s), "dropped": n}``, cumulative."""

    def __init__(self, labels: Mapping[str, str], stats: Callable[[], Mapping]) -> None:
        self.keys, self.values = list(labels), list(labels.values())
        self.stats = stats

    def collect(self):
        s = self.stats()
        made = CounterMetricFamily(name("kv_dist_groups"), "Two-rank KV process groups set up, by side.",
                                   labels=[*self.keys, "side"])
        setup = CounterMetricFamily(name("kv_dist_group_setup_seconds"), "Seconds spent setting them up "
                                    "(attach, rendezvous, join), by side.", labels=[*self.keys, "side"])
        for side in ("send", "receive"):
            made.add_metric([*self.values, side], float(s[side][0]))
            setup.add_metric([*self.values, side], float(s[side][1]))
        yield made
        yield setup
        dropped = CounterMetricFamily(name("kv_dist_groups_dropped"), "Sending groups closed because a "
                                      "transfer on them failed.", labels=self.keys)
        dropped.add_metric(self.values, float(s["dropped"]))
        yield dropped


class EngineCollector(Collector):
    """The engine's own figures at scrape time, from ``LLMEngine.stats()``-shaped dicts:
    running, waiting, kv_usage, preemptions, prefix_cache_query_tokens / _hit_tokens,
    speculative (drafts, draft_tokens, accepted_tokens)."""

    def __init__(self, labels: Mapping[str, str], stats: Callable[[], Mapping]) -> None:
        self.keys, self.values = list(labels), list(labels.values())
        self.stats = stats

    def _family(self, kind, short, doc, value):
        fam = kind(name(short), doc, labels=self.keys)
        fam.add_metric(self.values, float(value))
        return fam

    def collect(self):
        s = self.stats()
        if not s:
            return
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._family(g, "num_requests_running", "Sequences in the engine's running batch.", s["running"])
        yield self._family(g, "num_requests_waiting", "Sequences waiting for a slot.", s["waiting"])
        yield self._family(g, "kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", s["kv_usage"])
        yield self._family(c, "num_preemptions", "Sequences preempted (recomputed later).", s["preemptions"])
        if "step_failures" in s:  # a node's engine loop counts them, not the engine
            yield self._family(c, "engine_step_failures", "Engine steps that raised (their requests failed and "
                               "moved).", s["step_failures"])
        yield self._family(c, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                           s["prefix_cache_query_tokens"])
        yield self._family(c, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                           s["prefix_cache_hit_tokens"])
        spec = s.get("speculative") or {}
        yield self._family(c, "spec_decode_num_drafts", "Verification steps that carried draft tokens.",
                           spec.get("drafts", 0))
        yield self._family(c, "spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.get("draft_tokens", 0))
        yield self._family(c, "spec_decode_num_accepted_tokens", "Draft tokens the target accepted.",
                           spec.get("accepted_tokens", 0))
        yield from self._tiers(s)

    def _tiers(self, s: Mapping):
        """Per-tier KV cache figures (engine/kv_tiers/stats.py), labelled ``tier``: device,
        host, disk. A node without tiers exports the device tier only."""
        keys = [*self.keys, "tier"]
        g, c = GaugeMetricFamily, CounterMetricFamily
        blocks = g(name("kv_tier_blocks"), "Cached KV blocks held per tier.", labels=keys)
        usage = g(name("kv_tier_usage"), "Fraction of each lower tier's capacity holding blocks (device: "
                  "kv_cache_usage_perc).", labels=keys)
        capacity = g(name("kv_tier_capacity_bytes"), "Bytes each lower tier may hold.", labels=keys)
        hits = c(name("kv_tier_hits"), "Prefix blocks reused from each tier (host and disk ones were brought "
                 "back into the device pool).", labels=keys)
        offload = c(name("kv_offload_bytes"), "KV bytes moved down into each tier (host: copied out of the "
                    "device pool; disk: block files written).", labels=keys)
        onboard = c(name("kv_onboard_bytes"), "KV bytes brought back out of each tier (host: into the device "
                    "pool; disk: read into host memory).", labels=keys)
        seconds = HistogramMetricFamily(name("kv_onboard_seconds"), "Time to bring KV back: host, one step's "
                                        "copies into the device pool; disk, one block file read and checked.",
                                        labels=keys)
        errors = c(name("kv_tier_errors"), "Tier failures, each a miss and never a failed request: checksum, "
                   "foreign (another model's or layout's file), no_space, io_error.", labels=[*keys, "reason"])
        device = [*self.values, "device"]
        blocks.add_metric(device, s.get("cached_blocks", 0))
        hits.add_metric(device, s.get("device_hit_blocks", 0))
        for tier, t in (s.get("tiers") or {}).items():
            labels = [*self.values, tier]
            blocks.add_metric(labels, t["blocks"])
            usage.add_metric(labels, t["usage"])
            capacity.add_metric(labels, t["capacity_bytes"])
            hits.add_metric(labels, t["hits"])
            offload.add_metric(labels, t["offload_bytes"])
            onboard.add_metric(labels, t["onboard_bytes"])
            h = t["onboard_seconds"]
            seconds.add_metric(labels, [(floatToGoString(b), n) for b, n in h["buckets"]], h["sum"])
            for reason, n in t["errors"].items():
                errors.add_metric([*labels, reason], n)
        yield from (blocks, usage, capacity, hits, offload, onboard, seconds, errors)


class _Forward(Collector):
    """Whatever ``registry`` holds now (MetricsServer.serve swaps it)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self):
        return self.registry.collect()


class MetricsServer:
    """prometheus_client's own HTTP exporter on ``host:port`` (0 = a free port), for processes
    that have no HTTP server of their own (the nodes). ``address`` is what the node registers."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        # What it serves can be swapped (``serve``): a node that switches role keeps its
        # endpoint (stopping one costs the exporter's 0.5 s poll) and shows the new role's registry.
        self._current = _Forward(registry)
        served = CollectorRegistry()
        served.register(self._current)
        self._server, self._thread = start_http_server(port, addr=host, registry=served)
        self.port: int = self._server.server_port
        self.address = f"{host}:{self.port}"

    def serve(self, registry: CollectorRegistry) -> None:
        """Serve ``registry`` from the next scrape on."""
        self._current.registry = registry

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
