"""The cluster fixtures every cluster test shares (a pytest plugin, loaded by the root conftest).

- ``local_cluster``: the embedded cluster (``pdserve up``'s parts: Redis, a local Ray, node
  actors, the router) on SmolLM2-135M, one per test module. A module configures it with the
  ``local_cluster`` marker, whose keywords are ``ClusterConfig`` fields plus ``engine`` (a dict
  of ``EngineConfig`` fields over the defaults here).
- ``smollm2_reference``: the same model in one process, the answer every cluster test
  compares with; built once per session.
- ``local_ray``: a bare local Ray with both pools, for tests that place actors themselves;
  ``ray_pools`` starts one with other pool sizes (a module's own Ray fixture yields from it).
- ``start_node``: an in-process node server (no Ray) on any engine; ``spawn_actor``: a node
  actor on the local Ray, as `pdserve up` places one.
- ``start_router``: an in-process router (``frontend.server.serve``) on free loopback ports.

Every cluster picks free ports and binds loopback only; the environment they need (Ray without
token auth or usage reporting, gRPC without fork handlers) is set once in the root conftest.
"""
from __future__ import annotations

import uuid

import pytest

from engine.config import CacheConfig, EngineConfig

SMOLLM2 = EngineConfig(model="smollm2-135m", dtype="float32", cache=CacheConfig(num_blocks=256))


@pytest.fixture(scope="session")
def smollm2_reference():
    from engine.engine import LLMEngine

    return LLMEngine(SMOLLM2)


@pytest.fixture(scope="module")
def local_cluster(request):
    from dataclasses import replace

    from deploy.launcher import ClusterConfig, LocalCluster

    marker = request.node.get_closest_marker("local_cluster")
    fields = dict(marker.kwargs) if marker is not None else {}
    engine = replace(SMOLLM2, **fields.pop("engine", {}))
    fields.setdefault("http_port", 0)
    config = ClusterConfig(engine=engine, grpc_port=0, dashboard_port=0, **fields)
    with LocalCluster(config) as cluster:
        yield cluster


def ray_pools(prefill: int, decode: int, *, num_cpus: int = 2, prefix: str = "test"):
    """A local Ray (this process its driver) whose node offers ``prefill`` and ``decode`` slots
    of the two pools' resources and ``num_cpus`` CPUs, in a fresh namespace ``prefix-…``, no
    dashboard, workers' logs kept from the driver; yields the ``ray`` module, then shuts it down
    (ending the node actors with the cluster)."""
    import ray

    from kv_index.nodes import Role
    from node.config import pool_resource

    ray.init(num_cpus=num_cpus, resources={pool_resource(Role.PREFILL): prefill, pool_resource(Role.DECODE): decode},
             include_dashboard=False, namespace=f"{prefix}-{uuid.uuid4().hex[:6]}", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def local_ray():
    yield from ray_pools(1, 1)


def start_node(role, node_id: str, engine, *, redis_url: str, namespace: str, **fields):
    """A started PrefillServer / DecodeServer in this process (the caller stops it). ``engine``
    is an EngineConfig, or an LLMEngine already built (tests that size its pool)."""
    from decode_node.server import DecodeServer
    from engine.engine import LLMEngine
    from kv_index.nodes import Role
    from node.config import NodeConfig
    from prefill_node.server import PrefillServer

    fields.setdefault("load_tokenizer", False)  # tiny models have no tokenizer
    built = isinstance(engine, LLMEngine)
    cfg = NodeConfig(node_id=node_id, role=role, redis_url=redis_url, namespace=namespace,
                     engine=engine.config if built else engine, **fields)
    cls = PrefillServer if cfg.role is Role.PREFILL else DecodeServer
    server = cls(cfg, engine) if built else cls(cfg)
    server.start()
    return server


def spawn_actor(role, node_id: str, *, num_cpus: float = 0, build=None, **fields):
    """A node actor (``node.actor.spawn_node``) serving ``NodeConfig(node_id, role, **fields)``
    with the role's server factory (``build``: another factory) on the local Ray; the caller
    waits for ``ready`` and ends it (or shuts Ray down)."""
    from deploy.nodes import server_builder
    from kv_index.nodes import Role
    from node.actor import spawn_node
    from node.config import NodeConfig

    cfg = NodeConfig(node_id=node_id, role=role, **fields)
    return spawn_node(cfg, build or server_builder(Role(role)), num_cpus=num_cpus)


def start_router(redis_url: str, tokenizer_dir, *, namespace: str | None = None, model_name: str = "m",
                 **fields):
    """A started in-process router (``frontend.server.serve``; the caller stops it). ``fields``
    are the other ``RouterConfig`` fields (``max_model_len`` at least). The defaults differ from
    RouterConfig's where a test router needs it: gRPC on a free port and no HTTP server
    (``http_port=0`` for one on a free port), the node view refreshed every 0.1 s, and a fresh
    namespace when none is given."""
    from frontend.server import serve
    from router.config import RouterConfig

    fields = {"port": 0, "http_port": None, "node_refresh_s": 0.1, **fields}
    namespace = namespace or f"router-{uuid.uuid4().hex[:6]}"
    return serve(RouterConfig(redis_url=redis_url, model_name=model_name, tokenizer_dir=str(tokenizer_dir),
                              namespace=namespace, **fields))
