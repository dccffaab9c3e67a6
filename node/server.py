"""What every serving node is besides its role's RPCs: one gRPC server with standard health
checking and reflection, the engine on its own thread, and the link to the KV index.

A role's server subclasses ``NodeServer``: it names its role and its gRPC services, builds its
engine, adds its servicers, and may extend ``stop`` and ``role_stats``. Everything else (role
check, bind, serve, register, heartbeat, stats, tear-down) is here, once.

Health: the port is bound only once the model is loaded (the engine is built before the server),
so while a node loads a probe gets no answer at all; from ``start`` it is SERVING, and ``drain``
or ``stop`` turns it NOT_SERVING before anything else.

Unhealthy (``max_step_failures`` engine steps failed in a row, or the engine thread died):
health turns NOT_SERVING, the node leaves the index, its engine stops (open streams end with
UNAVAILABLE), new requests get UNAVAILABLE naming ``health_reason``, and the reason goes to
the node's health record (kv_index/health.py) for `pdserve status`. Then ``on_unhealthy`` runs:
the Ray actor exits so that Ray restarts it (node/actor.py); a server in a test stays as it is.

Drain (SIGTERM on a node actor, ``stop`` from a supervisor): refuse new requests, heartbeat
``draining`` so routers skip the node, let the requests in flight finish (up to
``drain_timeout_s``), then stop. Backpressure: long calls are bounded (``node/admission.py``)
and so is the engine's waiting queue (``admit``); overload answers RESOURCE_EXHAUSTED with a
retry hint instead of queueing.

Start order matters: the gRPC port is bound first (that port on the advertised host is what the
node registers), the Prometheus /metrics endpoint starts (its address is registered too), the server starts
serving, and only then does the node appear in Redis, so a router never sees an address that
does not answer. Stop runs in reverse: leave Redis, stop serving, stop
the engine.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import ClassVar

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.engine import LLMEngine
from engine.parallel.executor import TensorParallelEngine
from kv_index.client import RedisTimeouts, redis_client
from kv_index.health import SERVING, UNHEALTHY, HealthStore
from kv_index.nodes import NodeInfo, OnboardTotals, Role
from kv_index.publisher import NodePublisher
from kv_transfer.dist_transport import DistKVSender
from kv_transfer.grpc_transport import KV_GRPC_OPTIONS, GrpcKVSender
from kv_transfer.shm_transport import ShmKVSender
from kv_transfer.tcp_transport import TcpKVSender
from kv_transfer.transport import FallbackKVSender, KVSender
from node.admission import InflightGate, LongRpcInterceptor, refuse_busy, refuse_draining
from node.config import NodeConfig, host_port
from node.engine_thread import AsyncEngine
from node.prefix_holder import PrefixHolder
from node.publisher import IndexPublisherThread
from node.request_parsing import ParseRequestsInterceptor
from protos.conventions import keepalive_ping_options
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from security.tls import add_port, members_only
from telemetry import tracing
from telemetry.metrics import MetricsServer, NodeMetrics

log = logging.getLogger(__name__)

HOLDER_SERVICE = kv_pb2.DESCRIPTOR.services_by_name["KVHolder"].full_name
PUSH_PREFIX_PATH = f"/{HOLDER_SERVICE}/PushPrefix"


@dataclass(frozen=True)
class Handover:
    """What a retiring role server leaves to the next one on the same node (``retire``)."""

    engine: object  # the LLMEngine (or TensorParallelEngine) the role servers are built on
    aengine: AsyncEngine
    publisher: IndexPublisherThread
    redis: redis.Redis
    metrics_server: MetricsServer | None  # the node's /metrics endpoint, serving the next role's registry
    drained: bool  # everything held finished before the drain timeout
    failed: int  # requests failed over to other nodes when it did not


class NodeServer:
    """One node: ``start`` binds, serves and registers (returns "host:port"); ``stop`` undoes it.

    Subclasses set ``role`` and ``services`` (full names of the gRPC services they add, which
    health and reflection then report) and add their servicers to ``self.grpc_server`` in
    ``__init__``, after calling this one.
    """

    role: ClassVar[Role]
    services: ClassVar[tuple[str, ...]]
    # What every node serves besides its role's services: PushPrefix (node/prefix_holder.py).
    common_services: ClassVar[tuple[str, ...]] = (HOLDER_SERVICE,)
    # Full method names ("/pkg.Service/Method") of the calls that hold a worker thread for a
    # whole request: bounded by config.stream_limit (node/admission.py).
    long_methods: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: NodeConfig, engine: LLMEngine | TensorParallelEngine,
                 kv_sender: KVSender | None = None) -> None:
        if config.role is not self.role:
            raise ValueError(f"{type(self).__name__} needs a {self.role.value}-role config, "
                             f"got role={config.role.value!r}")
        self.config = config
        # Tensor parallel (node/tp_engine.py): the engine is rank 0's; ``tp`` holds the workers
        # (closed by ``stop``) and every rank's KV pool (sends gather from them).
        self.tp = engine if isinstance(engine, TensorParallelEngine) else None
        self.engine = engine.engine if self.tp is not None else engine
        # The role's step budget (NodeConfig.prefill_step_tokens): a live switch builds this
        # server once the old role drained, so the old role's work never runs on the new budget.
        self.engine.set_step_tokens(config.step_tokens(self.role))
        # Before any RPC: the servicers' spans come from the process's provider (one per process,
        # so the first node in it names the service; in a cluster each node is its own process).
        tracing.setup_tracing(f"pdserve-{self.role.value}", config.otlp_endpoint)
        self.gate = InflightGate(config.stream_limit)
        self.draining = False
        self._drain_lock = threading.Lock()
        self._drained: bool | None = None  # drain's result once it has stopped the node
        self._handing_over = False  # set by ``retire``: ``stop`` leaves the engine and index link
        # The KV stream's options on every node: a decode node receives PushBlocks on this server.
        self.grpc_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.grpc_workers, thread_name_prefix=f"grpc-{config.node_id}"),
            # Keepalive: KV_GRPC_OPTIONS accept the router's and peers' pings; the node pings
            # them too (a frozen router's streams are cancelled here and their KV freed;
            # protos/conventions.py keepalive_server_options).
            options=KV_GRPC_OPTIONS + keepalive_ping_options(),
            # Outermost, under TLS: only members' certificates, not API clients' (security/tls.py);
            # then a request it cannot parse is INVALID_ARGUMENT before it takes a slot.
            interceptors=(*members_only(config.tls), ParseRequestsInterceptor(),
                          LongRpcInterceptor(self.gate, (*self.long_methods, PUSH_PREFIX_PATH), config.node_id)),
            maximum_concurrent_rpcs=config.rpc_limit,
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            (*self.served, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc_server)
        # Every node sends KV: a prefill node its prompts' to decode nodes, any node a prefix it
        # holds to a node that fetches it (PushPrefix). The receiver's advertised transports in
        # its order (shared memory on the same host, a torch.distributed group where both ends
        # run with kv_dist, then raw TCP; all plaintext, so only without TLS), then gRPC
        # (docs/cluster.md, "KV data plane").
        dist = [DistKVSender()] if config.kv_dist and config.tls is None else []
        self._dist_sender = dist[0] if dist else None
        fast = [ShmKVSender(), *dist, TcpKVSender()] if config.tls is None else []
        self.kv_sender: KVSender = kv_sender or FallbackKVSender(fast, GrpcKVSender(config.tls))
        self.holder = PrefixHolder(self)
        kv_pb2_grpc.add_KVHolderServicer_to_server(self.holder, self.grpc_server)
        self.aengine: AsyncEngine | None = None
        self.publisher: IndexPublisherThread | None = None
        self.address: str | None = None
        self._redis: redis.Redis | None = None
        # Prometheus metrics (telemetry/metrics.py): the role servers record requests and
        # transfers on ``self.metrics``; the engine's own figures are read at scrape time from
        # the engine loop's cached stats, so a scrape never waits for a step.
        self.metrics = NodeMetrics(config.served_model_name or config.engine.model, self.role.value, config.node_id,
                                   engine_stats=self._engine_stats)
        if self._dist_sender is not None:
            self.metrics.watch_dist(self._dist_stats)
        self.metrics_server: MetricsServer | None = None
        self.metrics_address: str | None = None
        # Called once, on a thread of its own, after the node turned unhealthy and left the index.
        self.on_unhealthy: Callable[[str], None] | None = None

    def start(self, handover: Handover | None = None) -> str:
        """Bind, serve, register; returns "host:port". ``handover``: the engine loop and index
        link of this node's previous role (``retire``), served on instead of new ones."""
        cfg = self.config
        advertised = cfg.advertised_host
        if advertised is None:
            raise ValueError(f"node {cfg.node_id} binds every interface ({cfg.host!r}): "
                             "set advertise_host to the address peers reach it at")
        # With TLS only cluster members (a certificate from the cluster's CA) get through.
        port = add_port(self.grpc_server, host_port(cfg.host, cfg.grpc_port), cfg.tls, require_client_auth=True)
        if port == 0:
            raise OSError(f"could not bind {cfg.host}:{cfg.grpc_port}")
        # Bound on cfg.host, registered as the advertised host: peers dial what is registered.
        self.address = host_port(advertised, cfg.advertise_grpc_port or port)
        if handover is not None and handover.metrics_server is not None:  # the same endpoint, this registry
            self.metrics_server = handover.metrics_server
            self.metrics_server.serve(self.metrics.registry)
            self.metrics_address = host_port(advertised, self.metrics_server.port)
        elif cfg.metrics_port is not None:  # answers before the node registers its address
            self.metrics_server = MetricsServer(self.metrics.registry, cfg.host, cfg.metrics_port)
            self.metrics_address = host_port(advertised, self.metrics_server.port)
        self._redis = handover.redis if handover else redis_client(
            cfg.redis_url, RedisTimeouts(cfg.redis_connect_timeout_s, cfg.redis_timeout_s))
        info = NodeInfo(
            node_id=cfg.node_id, role=cfg.role, grpc_address=self.address,
            fingerprint=self.engine.fingerprint, block_size=self.engine.block_size,
            num_blocks=self.engine.num_blocks, metrics_address=self.metrics_address or "",
            kv_endpoints=self.kv_endpoints(), matmul_ms=self._matmul_curve(),
        )
        if handover is None:
            index = NodePublisher(self._redis, info, ns=cfg.namespace, lease_s=cfg.lease_s)
            self.publisher = IndexPublisherThread(index, self._load, cfg.heartbeat_s)
            self.aengine = AsyncEngine(self.engine, on_kv_events=self.publisher.submit_events,
                                       name=f"engine-{cfg.node_id}", max_step_failures=cfg.max_step_failures,
                                       on_unhealthy=self._engine_unhealthy)
        else:  # the same loop, cache and index entry: its blocks stay listed
            self.publisher, self.aengine = handover.publisher, handover.aengine
            self.aengine.set_on_unhealthy(self._engine_unhealthy)
        try:
            self.grpc_server.start()
            for name in ("", *self.served):
                self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            if handover is None:
                self.publisher.start()
            else:  # the registry says the new role and address at once (one heartbeat)
                self.publisher.rebind(info, self._load)
            self.metrics.healthy.set(1)
            self._record_health(SERVING)
        except BaseException:
            # e.g. Redis refused the node's password: do not leave a serving but unregistered
            # node behind (a Redis that does not answer is waited for by the publisher thread).
            # A handed-over engine goes back to whoever handed it (node/role_switch.py).
            self._handing_over = handover is not None
            self.stop(deregister=False)
            raise
        log.info("%s node %s serving on %s", cfg.role.value, cfg.node_id, self.address)
        return self.address

    @property
    def served(self) -> tuple[str, ...]:
        """Full names of every gRPC service of this node (health and reflection list them)."""
        return (*self.services, *self.common_services)

    def _dist_stats(self) -> dict:
        """The dist transport's groups, both ways (telemetry/metrics.py DistCollector)."""
        s = self._dist_sender
        server = getattr(getattr(self, "inbox", None), "data_server", None)  # the role's KVInbox
        r = server.dist if server is not None else None
        return {"send": (s.groups_made, s.setup_s_total), "dropped": s.groups_dropped,
                "receive": (r.groups_made, r.setup_s_total) if r is not None else (0, 0.0)}

    def _matmul_curve(self) -> tuple[tuple[int, float], ...]:
        """Its matmul time per step by batch rows, as registered (the CPU kernel plan's; ()
        without one: a GPU, or kernels not tuned)."""
        plan = getattr(self.engine, "linear_plan", None)
        return plan.curve() if plan is not None else ()

    def kv_endpoints(self) -> tuple[str, ...]:
        """KV data-plane endpoints this node receives on besides gRPC (the decode role's)."""
        return ()

    def stop(self, deregister: bool = True, grace_s: float = 1.0) -> None:
        """``deregister=False`` leaves the Redis entry to expire with its lease, as a crash would."""
        # Health first: from here on a probe (or a load balancer) sees NOT_SERVING while the
        # node leaves the index and finishes its in-flight calls.
        self.health.enter_graceful_shutdown()
        keep = self._handing_over  # a role switch: the engine and index link live on (``retire``)
        if self.publisher is not None and not keep:
            self.publisher.stop(deregister=deregister)
        self.grpc_server.stop(grace_s).wait()
        self.kv_sender.close()
        if self.aengine is not None and not keep:
            self.aengine.shutdown()
        if self.tp is not None and not keep:  # after the engine loop: no step is left to broadcast
            self.tp.close()
        if self.metrics_server is not None and not keep:
            self.metrics_server.stop()
            self.metrics_server = None
        if self._redis is not None and not keep:
            self._redis.close()
        tracing.flush()  # a stopping node's last spans are still in the batch exporter

    # ---- health
    @property
    def health_reason(self) -> str | None:
        """Why this node is unhealthy (None: it is not): its engine's reason."""
        return self.aengine.unhealthy_reason if self.aengine is not None else None

    def set_step_fault(self, steps: int, fatal: bool = False) -> int:
        """Fault injection (node/faults.py): the next ``steps`` engine steps raise (-1: every
        step until ``set_step_fault(0)``; ``fatal``: the engine thread dies of it). Called in
        this process only (the node actor's ``set_step_fault``, tests); nothing on the wire
        reaches it. Returns the steps failed so far."""
        return self.aengine.set_step_fault(steps, fatal)

    def _engine_unhealthy(self, reason: str) -> None:
        # The engine loop's last act: leave the index and tell the actor from a thread of our own.
        threading.Thread(target=self._become_unhealthy, args=(reason,), name=f"unhealthy-{self.config.node_id}",
                         daemon=True).start()

    def _become_unhealthy(self, reason: str) -> None:
        log.error("%s is unhealthy: %s; leaving the index", self.config.node_id, reason)
        for name in ("", *self.served):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.metrics.healthy.set(0)
        # The record before the leave: whoever sees the node gone from the index (a router,
        # `pdserve status`, a test) then finds why, never a stale "serving".
        self._record_health(UNHEALTHY, reason)
        if self.publisher is not None:
            self.publisher.stop(deregister=True)
        if self.on_unhealthy is not None:
            self.on_unhealthy(reason)

    def _record_health(self, state: str, reason: str | None = None) -> None:
        """The node's health record (kv_index/health.py): a hint for operators, never a reason
        to fail."""
        if self._redis is None:
            return
        try:
            HealthStore(self._redis, self.config.namespace).write(self.config.node_id, state, reason)
        except redis.RedisError as err:
            log.warning("could not record %s's health (%s): %s", self.config.node_id, state, err)

    # ---- admission and drain
    def admit(self, context: grpc.ServicerContext, accepted: bool = False) -> None:
        """Refuse a new request (aborting its RPC) while unhealthy or draining, or when the
        engine's waiting queue is full. ``accepted``: the call finishes a request this node
        already took (a Decode over KV it reserved): only health and the waiting bound apply."""
        reason = self.health_reason
        if reason is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"node {self.config.node_id} is unhealthy: {reason}")
        if self.draining and not accepted:
            refuse_draining(context, self.config.node_id)
        load = self.aengine.load if self.aengine is not None else None
        if not accepted and load is not None and load.waiting >= self.config.max_waiting:
            refuse_busy(context, f"node {self.config.node_id} has {load.waiting} requests waiting for "
                                 f"its engine (max_waiting {self.config.max_waiting})")

    def drain(self, timeout_s: float | None = None) -> bool:
        """Stop taking requests, finish those in flight (up to ``timeout_s``, default
        config.drain_timeout_s), then ``stop``: leave the index and stop serving. Returns
        whether everything in flight finished in time. Idempotent; thread-safe.

        While draining the node reports NOT_SERVING, refuses new requests with UNAVAILABLE and
        a retry hint, and heartbeats ``draining`` so routers stop placing here; calls that
        finish accepted requests (Decode over reserved KV, its PushBlocks) still get in.
        """
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        self.draining = True  # refuse newcomers at once, even while a first drain holds the lock
        with self._drain_lock:  # a second drain (SIGTERM, then a supervisor's stop) waits for the first
            if self._drained is not None:
                return self._drained
            log.info("%s draining (up to %.0f s)", self.config.node_id, timeout_s)
            for name in ("", *self.served):
                self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            if self.publisher is not None:
                self.publisher.beat_now()
            idle = self.gate.wait_idle(timeout_s, self.idle)
            if not idle:
                log.warning("%s: drain timed out after %.0f s with %d calls in flight; stopping them",
                            self.config.node_id, timeout_s, self.gate.inflight)
            self.stop()
            self._drained = idle
            return idle

    def retire(self, timeout_s: float) -> Handover:
        """Stop serving this role and hand the engine on (a live role switch, node/role_switch.py):
        ``drain``, except that the engine loop, its cache and the index link go on. Work still
        held after ``timeout_s`` fails with UNAVAILABLE (routers move it: router/migration.py)
        and reservations are freed; the gRPC port and the role's receivers close."""
        self.draining = True
        with self._drain_lock:
            if self._drained is not None:
                raise RuntimeError(f"{self.config.node_id} already stopped: nothing to hand over")
            for name in ("", *self.served):
                self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            self.publisher.beat_now()  # draining: routers place nothing new here
            idle = self.gate.wait_idle(timeout_s, self.idle)
            failed = 0
            if not idle:
                failed = self.aengine.fail_open(f"node {self.config.node_id} is switching role")
                log.warning("%s: role switch drain timed out after %.1f s; %d requests failed over to other "
                            "nodes, %d calls in flight", self.config.node_id, timeout_s, failed, self.gate.inflight)
            self.engine.set_kv_layer_listener(None)  # the prefill role's; the next role sets its own
            self._handing_over = True
            self.stop(grace_s=1.0)  # failed streams flush their error; then every call ends
            self.release_held()
            self._drained = idle
        return Handover(self.tp or self.engine, self.aengine, self.publisher, self._redis, self.metrics_server,
                        idle, failed)

    def release_held(self) -> None:
        """Free the reservations of requests that will not come back here (the role's
        inbox: prompts a decode node awaited, prefixes a node fetched): the engine serves on
        under another role, and a reservation nobody takes would hold its blocks for good."""
        inbox = getattr(self, "inbox", None)  # the role's KVInbox (node/kv_inbox.py)
        if inbox is None:
            return
        for rid in inbox.reservations.ids():
            inbox.drop(rid)  # a push still in flight releases at its end

    def idle(self) -> bool:
        """Nothing accepted is left unfinished besides calls in flight (the role adds its
        own: reservations awaiting their KV)."""
        return True

    def stats(self) -> dict:
        """What ``pdserve status`` and the actor's ``stats`` show: identity, load, the engine's
        cumulative counters (as on /metrics), role figures."""
        s = self._engine_stats() or {}
        counters = {k: s[k] for k in ("preemptions", "prefix_cache_query_tokens", "prefix_cache_hit_tokens") if k in s}
        return {"node_id": self.config.node_id, "role": self.role.value, "address": self.address,
                "metrics_address": self.metrics_address, **self._load(), **counters,
                "step_tokens": self.engine.step_tokens,  # the role's step budget (NodeConfig.step_tokens)
                "healthy": self.health_reason is None, "health_reason": self.health_reason,
                "step_failures": self.aengine.num_step_errors if self.aengine is not None else 0,
                "inflight_calls": self.gate.inflight, "refused_calls": self.gate.num_refused,
                **(self.publisher.counts() if self.publisher is not None else {}), **self.role_stats()}

    def _engine_stats(self) -> dict | None:
        """The engine loop's cached ``LLMEngine.stats()`` and its failed steps (None before
        ``start``)."""
        if self.aengine is None:
            return None
        return {**self.aengine.stats, "step_failures": self.aengine.num_step_errors}

    def role_stats(self) -> dict:
        """The role's own figures (prefills done, reservations held, ...)."""
        return {}

    def _load(self) -> dict:
        if self.aengine is None:
            return {}
        return {**self.aengine.load.as_dict(), "draining": int(self.draining), **onboard_fields(self.aengine.stats)}


def onboard_fields(stats: dict) -> dict[str, str]:
    """The heartbeat's ``onboard_host`` / ``onboard_disk`` (kv_index.nodes.OnboardTotals) from the
    engine's stats: what routers fit each tier's onboard cost on."""
    tiers = stats.get("tiers") or {}
    out = {}
    for name in ("host", "disk"):
        t = tiers.get(name)
        if t:
            secs = t["onboard_seconds"]
            out[f"onboard_{name}"] = OnboardTotals(t["onboard_bytes"], secs["sum"], secs["count"]).wire()
    return out
