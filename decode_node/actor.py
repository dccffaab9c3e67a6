"""The decode node as a Ray actor in the decode pool (the body is kv_transfer/node_actor.py)."""
from __future__ import annotations

import ray

from kv_transfer.node_actor import NodeActorBody, spawn_node
from kv_transfer.node_config import NodeConfig


@ray.remote
class DecodeNodeActor(NodeActorBody):
    @staticmethod
    def make_server(config: NodeConfig):
        from decode_node.server import DecodeServer  # torch loads in the worker only

        return DecodeServer(config)


def spawn_decode_node(
    config: NodeConfig, *, gpu: bool = False, accelerator_type: str | None = None, num_cpus: float = 1
):
    """Start a decode node actor named ``config.node_id`` in the decode pool; returns its handle."""
    if config.role != "decode":
        raise ValueError(f"spawn_decode_node needs a decode-role config, got role={config.role!r}")
    return spawn_node(DecodeNodeActor, config, gpu=gpu, accelerator_type=accelerator_type, num_cpus=num_cpus)
