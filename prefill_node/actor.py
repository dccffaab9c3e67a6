"""The prefill node as a Ray actor in the prefill pool (the body is kv_transfer/node_actor.py)."""
from __future__ import annotations

import ray

from kv_transfer.node_actor import NodeActorBody, spawn_node
from kv_transfer.node_config import NodeConfig


@ray.remote
class PrefillNodeActor(NodeActorBody):
    @staticmethod
    def make_server(config: NodeConfig):
        from prefill_node.server import PrefillServer  # torch loads in the worker only

        return PrefillServer(config)


def spawn_prefill_node(
    config: NodeConfig, *, gpu: bool = False, accelerator_type: str | None = None, num_cpus: float = 1
):
    """Start a prefill node actor named ``config.node_id`` in the prefill pool; returns its handle."""
    if config.role != "prefill":
        raise ValueError(f"spawn_prefill_node needs a prefill-role config, got role={config.role!r}")
    return spawn_node(PrefillNodeActor, config, gpu=gpu, accelerator_type=accelerator_type, num_cpus=num_cpus)
