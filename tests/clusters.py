"""The cluster fixtures every cluster test shares (a pytest plugin, loaded by the root conftest).

- ``local_cluster``: the embedded cluster (``pdserve up``'s parts: Redis, a local Ray, node
  actors, the router) on SmolLM2-135M, one per test module. A module configures it with the
  ``local_cluster`` marker, whose keywords are ``ClusterConfig`` fields plus ``engine`` (a dict
  of ``EngineConfig`` fields over the defaults here).
- ``smollm2_reference``: the same model in one process, the answer every cluster test
  compares with; built once per session.
- ``local_ray``: a bare local Ray with both pools, for tests that place actors themselves.
- ``start_node``: an in-process node server (no Ray) on any engine.

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


@pytest.fixture(scope="module")
def local_ray():
    import ray

    from kv_index.nodes import Role
    from node.config import pool_resource

    ray.init(num_cpus=2, resources={pool_resource(Role.PREFILL): 1, pool_resource(Role.DECODE): 1},
             include_dashboard=False, namespace=f"test-{uuid.uuid4().hex[:6]}", log_to_driver=False)
    yield
    ray.shutdown()


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
