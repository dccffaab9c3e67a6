"""The prefill node as a Ray actor in the prefill pool.

Ray places, restarts and names the node; gRPC carries everything else (no tensors through
Ray). A restarted actor builds a fresh engine and registers again, which drops whatever its
previous life published to the index (NodePublisher.register).
"""
from __future__ import annotations

import os

import ray

from kv_transfer.node_config import NodeConfig, ray_actor_options


@ray.remote
class PrefillNodeActor:
    def __init__(self, config: NodeConfig) -> None:
        from prefill_node.server import PrefillServer  # torch loads in the worker only

        self._server = PrefillServer(config)
        self._address = self._server.start()

    def address(self) -> str:
        return self._address

    def ready(self) -> bool:
        return self._server.aengine is not None and self._server.aengine.alive

    def stats(self) -> dict:
        # The pid tells restarts apart (a restarted actor is a new process).
        return {**self._server.stats(), "pid": os.getpid()}

    def stop(self) -> None:
        """Leave the index and stop serving (then end the actor with ray.kill)."""
        self._server.stop()


def spawn_prefill_node(
    config: NodeConfig, *, gpu: bool = False, accelerator_type: str | None = None, num_cpus: float = 1
):
    """Start a prefill node actor named ``config.node_id`` in the prefill pool; returns its handle."""
    if config.role != "prefill":
        raise ValueError(f"spawn_prefill_node needs a prefill-role config, got role={config.role!r}")
    opts = ray_actor_options(config, gpu=gpu, accelerator_type=accelerator_type, num_cpus=num_cpus)
    return PrefillNodeActor.options(**opts).remote(config)
