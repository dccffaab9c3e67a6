"""The router's HTTP front: FastAPI served by uvicorn on the router's own event loop, beside
its gRPC server. This module assembles the app (``build_app``) from its parts and serves it
(``HttpServer``):

    frontend/http_routes.py    the routes: OpenAI-compatible API, /health, /ready, /metrics
    frontend/http_errors.py    every failure in OpenAI's error shape
    frontend/http_front.py     the request's bounds: admission, body limit, byte budget, JSON depth
    frontend/http_conn.py      the connection's: open connections, header and send deadlines
    here                     the API-key check (401) in front of them, the readiness check,
                             uvicorn

A request passes the API-key check (when keys are set), then the front door's bounds, then
FastAPI's validation, then its route.
"""
from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.middleware.base import BaseHTTPMiddleware

from frontend import openai_protocol as oai
from frontend.http_conn import guarded_protocol
from frontend.http_errors import add_error_handlers
from frontend.http_front import OPEN_PATHS, FrontDoor, front_limits
from frontend.http_routes import Served, routes
from kv_index.nodes import Role
from router.orchestrator import Orchestrator
from security.api_keys import MISSING, ApiKeys


def build_app(orch: Orchestrator, metrics_registry=None,
              readiness: Callable[[], tuple[bool, str]] | None = None) -> FastAPI:
    cfg = orch.config
    app = FastAPI(title="pdserve", description="OpenAI-compatible API of a pdserve cluster",
                  docs_url=None, redoc_url=None)
    app.state.served = Served(orch, metrics_registry, readiness)
    app.state.front = front_limits(cfg, orch.tokenizer)
    metrics = getattr(orch, "metrics", None)
    app.add_middleware(FrontDoor, limits=app.state.front, on_refused=metrics.rejected if metrics else None)
    if cfg.api_keys:  # added last, so it runs first: a request without a key is not even read
        app.add_middleware(RequireApiKey, keys=ApiKeys(cfg.api_keys))
    add_error_handlers(app)
    app.include_router(routes)
    return app


class RequireApiKey(BaseHTTPMiddleware):
    """Every route but OPEN_PATHS answers 401 in OpenAI's shape without an accepted
    ``Authorization: Bearer`` key."""

    def __init__(self, app, keys: ApiKeys) -> None:
        super().__init__(app)
        self.keys = keys

    async def dispatch(self, request: Request, call_next):
        if request.url.path in OPEN_PATHS:
            return await call_next(request)
        why = self.keys.check_authorization(request.headers.get("authorization"))
        if why is None:
            return await call_next(request)
        code = None if why == MISSING else "invalid_api_key"
        return JSONResponse(oai.error_json(why, "invalid_request_error", code, None), status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})


def node_readiness(orch: Orchestrator, min_prefill: int) -> Callable[[], tuple[bool, str]]:
    """/ready: a decode node and ``min_prefill`` prefill nodes live in the router's node view."""

    def check() -> tuple[bool, str]:
        if orch.draining:
            return False, "the router is shutting down (draining)"
        view = orch.refresher.view
        decode = sum(1 for n in view.nodes if n.role == Role.DECODE)
        prefill = sum(1 for n in view.nodes if n.role == Role.PREFILL)
        missing = []
        if decode < 1:
            missing.append("no live decode node")
        if prefill < min_prefill:
            missing.append(f"{prefill} live prefill nodes (need {min_prefill})")
        if missing:
            return False, "; ".join(missing) + (f" ({view.error})" if view.error else "")
        return True, f"{prefill} prefill and {decode} decode nodes live"

    return check


class HttpServer:
    """uvicorn on the caller's running event loop. ``start`` binds (port 0 = a free one) and
    returns "host:port" once it accepts connections. uvicorn's own ``limit_concurrency`` is
    not used: past it uvicorn answers a plain-text 503, where the front door (the app's
    ``FrontDoor``) answers OpenAI's 429 with Retry-After; ``header_timeout_s`` bounds the wait
    for a request's headers; the app's ``FrontLimits`` the open connections and the send
    deadline (``guarded_protocol``)."""

    def __init__(self, app: FastAPI, host: str, port: int, ssl: dict | None = None,
                 header_timeout_s: float = 20.0, reuse_port: bool = False) -> None:
        self.app, self.host, self.port = app, host, port
        self.reuse_port = reuse_port  # router replicas on one port (RouterConfig.reuse_port)
        self.protocol = guarded_protocol(header_timeout_s, app.state.front)
        self.ssl = ssl or {}  # uvicorn's ssl_* keywords: HTTPS (security.tls.uvicorn_ssl)
        self.address: str | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> str:
        # Bind here, not in uvicorn, so port 0 works and the bound port is known at once.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((self.host, self.port))
        sock.set_inheritable(True)
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off", http=self.protocol,
                                timeout_graceful_shutdown=5, **self.ssl)
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the bind/startup error
                raise OSError(f"HTTP server on {self.host}:{self.port} stopped during startup")
            await asyncio.sleep(0.01)
        port = sock.getsockname()[1]
        host = f"[{self.host}]" if family == socket.AF_INET6 else self.host
        self.address = f"{host}:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(self._task, timeout=10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._server.force_exit = True
