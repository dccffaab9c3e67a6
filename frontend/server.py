"""The router process: its client-facing gRPC server (PdServe: Generate, Abort, ListModels;
the standard grpc.health.v1 service; server reflection) and, beside it on the same event loop,
the HTTP server (OpenAI-compatible API, /metrics, /health, /ready: frontend/http_server.py).

    python -m frontend.server --redis-url redis://127.0.0.1:6379/0 --tokenizer-dir DIR \
        --model-name smollm2-135m --max-model-len 2048 --port 50051 --http-port 8000

It runs on grpc.aio: a request spends its life waiting on nodes, so one event loop carries
thousands of them where a thread per stream would not. ``serve(config)`` runs that loop on a
thread of its own so callers (the launcher, tests) stay synchronous.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from frontend.grpc_parsing import add_parsing_servicer
from frontend.http_server import HttpServer, build_app, node_readiness
from kv_index.client import RedisTimeouts, redis_client
from kv_index.event_feed import EventFeed
from kv_index.nodes import index_freshness
from kv_index.reader import IndexReader
from kv_index.redis_url import resolve_redis_url
from protos.conventions import grpc_options, keepalive_server_options, retry_after_metadata
from protos.pdserve.v1 import serving_pb2 as pb
from protos.pdserve.v1 import serving_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.cost_model import CostBook
from router.index_guard import GuardedLookup, LookupBreaker
from router.node_view import NodeRefresher
from router.orchestrator import Orchestrator, RouterError
from router.placement import PrefixLoadPolicy, TtftPolicy
from router.planner.config import add_planner_arguments, planner_config
from router.planner.loop import router_planner
from router.replicas import LoadShare, new_replica_id
from router.tokenizer import PromptTokenizer
from security import tls as tls_
from security.api_keys import ApiKeyInterceptor, ApiKeys, authorization_of, keys_from
from settings.flags import add_arguments, from_args
from telemetry import tracing
from telemetry.metrics import RouterMetrics
from tool_calling.requests import CallCollector, parses_calls

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PdServe"].full_name


class PdServeService(pb_grpc.PdServeServicer):
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orch = orchestrator

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        # Tools given: each sample's Complete carries the calls parsed from its text.
        fmt = self.orch.tokenizer.tool_format
        calls = CallCollector(fmt) if fmt is not None and parses_calls(request) else None
        try:
            parent = tracing.context_from_metadata(context.invocation_metadata())  # a client's traceparent
            # The key (checked by the interceptor) salts the request's cache blocks per tenant.
            auth = authorization_of(context.invocation_metadata())
            async for resp in self.orch.generate(request, trace_context=parent, authorization=auth):
                yield calls.feed(resp) if calls is not None else resp
        except RouterError as e:
            md = retry_after_metadata(e.retry_after_ms) if e.retry_after_ms is not None else ()
            await context.abort(e.code, e.message, trailing_metadata=md)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        return pb.AbortResponse(found=await self.orch.abort(request.request_id))

    async def ListModels(self, request, context) -> pb.ListModelsResponse:
        cfg = self.orch.config
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=cfg.model_name, max_context_length=cfg.max_model_len)])


class RouterServer:
    """A running router. ``address`` is host:port as bound (port 0 picks a free one)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.address: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._grace = 0.0
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, name="router-server", daemon=True)
        self.orchestrator: Orchestrator | None = None  # set once started: stats(), accuracy
        self.http_address: str | None = None  # host:port of the HTTP API (None: not serving HTTP)
        self.load_share = None  # router.replicas.LoadShare once started: this replica in Redis

    def start(self) -> "RouterServer":
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self, grace: float = 0.0) -> None:
        if self._loop is not None and self._stopping is not None and self._thread.is_alive():
            self._grace = grace
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join()

    def wait(self) -> None:
        self._thread.join()

    def drain(self, timeout_s: float | None = None) -> bool:
        """SIGTERM: report NOT_SERVING, refuse new requests (UNAVAILABLE + retry hint), let
        those in flight finish for up to ``timeout_s`` (default config.drain_timeout_s), then
        stop. Returns whether they all finished."""
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        orch = self.orchestrator
        if orch is None or self._loop is None:
            self.stop()
            return True
        orch.draining = True  # read on the loop; a plain attribute store is atomic
        deadline = time.monotonic() + timeout_s
        while orch.inflight and time.monotonic() < deadline:
            time.sleep(0.05)
        done = orch.inflight == 0
        if not done:
            log.warning("router drain timed out after %.0f s with %d requests in flight", timeout_s, orch.inflight)
        self.stop(grace=1.0)
        return done

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # reported to start(); a failed start must not hang it
            self._error = e
            self._started.set()

    async def _main(self) -> None:
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        tracing.setup_tracing("pdserve-router", cfg.otlp_endpoint)
        # Two clients: the background thread's, and the request path's lookup with a short bound.
        client = redis_client(cfg.redis_url, RedisTimeouts(cfg.redis_connect_timeout_s, cfg.redis_timeout_s))
        lookup_client = redis_client(cfg.redis_url, RedisTimeouts(cfg.index_lookup_timeout_s,
                                                                  cfg.index_lookup_timeout_s))
        reader = IndexReader(client, cfg.namespace)
        lookup = GuardedLookup(IndexReader(lookup_client, cfg.namespace), LookupBreaker(base_s=cfg.node_refresh_s),
                               local=EventFeed(client, cfg.namespace) if cfg.index_lookup == "local" else None)
        costs = CostBook(kv_bytes_per_token=cfg.kv_bytes_per_token) if cfg.kv_bytes_per_token else CostBook()
        refresher = NodeRefresher(reader, cfg.node_refresh_s, cfg.prune_every_s, costs, cfg.registry_outage_s,
                                  lookup=lookup, settle_s=cfg.registry_settle_s)
        if cfg.policy == "ttft":
            policy = TtftPolicy(costs, cfg.short_prompt_tokens, cfg.max_n, compute_weight=cfg.compute_weight,
                                slow_step_factor=cfg.straggler_factor, replicate=cfg.prefix_fetch,
                                local_uncached_tokens=cfg.local_prefill_uncached_tokens)
        else:
            policy = PrefixLoadPolicy(cfg.load_alpha, cfg.short_prompt_tokens, cfg.max_n,
                                      slow_step_factor=cfg.straggler_factor)
        metrics = RouterMetrics(cfg.model_name)
        orch = self.orchestrator = Orchestrator(cfg, PromptTokenizer(cfg.tokenizer_dir), refresher, lookup,
                                                policy, costs, metrics)
        accuracy = orch.accuracy
        metrics.watch_index(lambda: index_freshness(refresher.view.nodes, time.time()),
                            lambda: accuracy.summary()["exact_fraction"] if accuracy.requests else None)
        metrics.watch_transfers(costs.transfer_fits)
        metrics.watch_degraded(lambda: refresher.degraded is not None, lambda: (lookup.failures, lookup.skipped))
        planner = (router_planner(cfg.planner, client, cfg.namespace, refresher, costs, orch, policy,
                                  metrics.planner_decision) if cfg.planner.enabled else None)
        server, health_servicer, port = _grpc_server(cfg, orch)
        lookup.start(timeout_s=cfg.redis_timeout_s)
        refresher.start()
        await server.start()
        if planner is not None:
            planner.start()
        self.address = f"{cfg.host}:{port}"
        # The other replicas' in-flight load into this one's ledger (router/replicas.py).
        share = self.load_share = LoadShare(client, cfg.namespace, cfg.replica_id or new_replica_id(), orch.ledger,
                                            cfg.node_refresh_s, address=self.address, inflight=lambda: orch.inflight)
        await asyncio.to_thread(share.start)
        http = None
        if cfg.http_port is not None:
            app = build_app(orch, metrics.registry, node_readiness(orch, cfg.ready_min_prefill))
            http = HttpServer(app, cfg.host, cfg.http_port,
                              ssl=tls_.uvicorn_ssl(cfg.tls, require_client_auth=cfg.tls_client_auth),
                              header_timeout_s=cfg.http_header_timeout_s, reuse_port=cfg.reuse_port)
            try:
                self.http_address = await http.start()
            except BaseException:
                await server.stop(0)
                await asyncio.to_thread(share.stop)
                refresher.stop()
                lookup.close()
                raise
        log.info("router serving %s on %s (gRPC), %s (HTTP)", cfg.model_name, self.address, self.http_address)
        self._started.set()
        health_task = asyncio.create_task(_track_health(health_servicer, orch, cfg.node_refresh_s))
        try:
            await self._stopping.wait()
        finally:
            health_task.cancel()
            if planner is not None:
                await asyncio.to_thread(planner.stop)
            if http is not None:
                await http.stop()
            await server.stop(self._grace)
            await asyncio.to_thread(share.stop)
            refresher.stop()
            lookup.close()
            await orch.close()
            client.close()
            lookup_client.close()
            tracing.flush()  # the batch exporter holds the last requests' spans


def _grpc_server(cfg: RouterConfig, orch: Orchestrator):
    """The client-facing gRPC server, bound (not started): (server, its health servicer, port)."""
    # Client routes need an API key when keys are configured (health stays open).
    interceptors = [ApiKeyInterceptor(ApiKeys(cfg.api_keys))] if cfg.api_keys else []
    # A bound on the RPCs held at once (memory under overload): Generate is bounded by
    # max_inflight (429 + retry hint) well before; the rest covers Abort, health, reflection.
    # Clients may ping (keepalive) without being cut off as abusive; the router itself does
    # not ping its clients (protos/conventions.py keepalive_server_options).
    # SO_REUSEPORT only for replicas (gRPC's default is on: a stray second router would share
    # the port silently).
    reuse = [("grpc.so_reuseport", 1 if cfg.reuse_port else 0)]
    server = grpc.aio.server(options=grpc_options(cfg.max_message_bytes) + keepalive_server_options() + reuse,
                             interceptors=interceptors,
                             maximum_concurrent_rpcs=cfg.rpc_limit)
    # Requests are parsed by us: malformed bytes get INVALID_ARGUMENT naming the field.
    add_parsing_servicer(PdServeService(orch), pb.DESCRIPTOR.services_by_name["PdServe"], server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = tls_.add_port(server, f"{cfg.host}:{cfg.port}", cfg.tls, require_client_auth=cfg.tls_client_auth)
    if port == 0:
        raise OSError(f"could not bind {cfg.host}:{cfg.port}")
    return server, health_servicer, port


async def _track_health(servicer, orch: Orchestrator, every_s: float) -> None:
    """SERVING while a decode node is live and the router is not draining: a load balancer
    then sends traffic elsewhere when this router could only answer UNAVAILABLE."""
    last = None
    while True:
        status = (health_pb2.HealthCheckResponse.SERVING if orch.refresher.view.has_decode and not orch.draining
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        if status != last:
            for name in ("", SERVICE_NAME):
                await servicer.set(name, status)
            last = status
        await asyncio.sleep(every_s)


def serve(config: RouterConfig) -> RouterServer:
    """Start a router; returns once it accepts connections."""
    return RouterServer(config).start()


def build_parser() -> argparse.ArgumentParser:
    """``python -m frontend.server``'s flags: one per RouterConfig field that declares one, and
    the planner's (the Helm chart's router args are checked against it)."""
    p = argparse.ArgumentParser(description="pdserve router (gRPC)")
    add_arguments(p, RouterConfig)
    add_planner_arguments(p)
    return p


def config_from_args(args: argparse.Namespace, env) -> RouterConfig:
    """The RouterConfig of parsed ``build_parser`` flags; the Redis password and the API keys
    may come from ``env``."""
    return from_args(RouterConfig, args, redis_url=resolve_redis_url(args.redis_url, env),
                     api_keys=keys_from(args.api_keys, env), planner=planner_config(args))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = serve(config_from_args(args, os.environ))
    print(f"router listening on grpc={server.address} http={server.http_address}", flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: threading.Thread(target=server.drain).start())
    server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
