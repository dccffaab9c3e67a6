"""What every serving node runs besides its own RPCs: the engine loop, one gRPC server with
standard health checking, and the Redis registration / heartbeat / KV-event publisher.

Start order matters: the gRPC port is bound first (its address is what the node registers),
the server starts serving, and only then does the node appear in Redis, so a router never
sees an address that does not answer. Stop runs in reverse: leave Redis, stop serving, stop
the engine.
"""
from __future__ import annotations

import logging
from concurrent import futures

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.async_engine import AsyncEngine
from engine.engine import LLMEngine
from kv_transfer.grpc_transport import GRPC_OPTIONS
from kv_transfer.kv_index import NodeInfo, NodePublisher
from kv_transfer.node_config import NodeConfig
from kv_transfer.node_publisher import IndexPublisherThread

log = logging.getLogger(__name__)


class NodeRuntime:
    def __init__(self, config: NodeConfig, engine: LLMEngine, service_names: tuple[str, ...]) -> None:
        self.config = config
        self.engine = engine
        self.service_names = service_names
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.grpc_workers, thread_name_prefix=f"grpc-{config.node_id}"),
            options=GRPC_OPTIONS,
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._publisher: IndexPublisherThread | None = None
        self.aengine: AsyncEngine | None = None
        self._redis: redis.Redis | None = None
        self.address: str | None = None

    def start(self) -> str:
        """Bind, serve, register; returns "host:port"."""
        cfg = self.config
        port = self.server.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}")
        if port == 0:
            raise OSError(f"could not bind {cfg.host}:{cfg.grpc_port}")
        self.address = f"{cfg.host}:{port}"
        self._redis = redis.Redis.from_url(cfg.redis_url)
        info = NodeInfo(
            node_id=cfg.node_id, role=cfg.role, grpc_address=self.address,
            fingerprint=self.engine.fingerprint, block_size=self.engine.block_size,
            num_blocks=self.engine.num_blocks,
        )
        publisher = NodePublisher(self._redis, info, ns=cfg.namespace, lease_s=cfg.lease_s)

        def load() -> dict:
            return self.aengine.load.as_dict() if self.aengine is not None else {}

        self._publisher = IndexPublisherThread(publisher, load, cfg.heartbeat_s)
        self.aengine = AsyncEngine(self.engine, on_kv_events=self._publisher.submit_events,
                                   name=f"engine-{cfg.node_id}")
        try:
            self.server.start()
            for name in ("", *self.service_names):
                self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            self._publisher.start()
        except BaseException:
            # e.g. Redis unreachable: do not leave a serving but unregistered node behind.
            self.stop(deregister=False)
            raise
        log.info("%s node %s serving on %s", cfg.role, cfg.node_id, self.address)
        return self.address

    def stop(self, deregister: bool = True, grace_s: float = 1.0) -> None:
        """``deregister=False`` leaves the Redis entry to expire with its lease, as a crash would."""
        if self._publisher is not None:
            self._publisher.stop(deregister=deregister)
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        if self.aengine is not None:
            self.aengine.shutdown()
        if self._redis is not None:
            self._redis.close()

    @property
    def publisher(self) -> IndexPublisherThread | None:
        return self._publisher
