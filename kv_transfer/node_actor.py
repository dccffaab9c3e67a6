"""The body of a node's Ray actor, whatever its role (Ray-free: each role's package declares
its actor class with ``@ray.remote`` on top of this).

Ray places, restarts and names the node; gRPC carries everything else (no tensors through
Ray). A restarted actor builds a fresh engine and registers again, which drops whatever its
previous life published to the index (NodePublisher.register).
"""
from __future__ import annotations

import os

from kv_transfer.node_config import NodeConfig, ray_actor_options


class NodeActorBody:
    """Starts the role's server in the actor process; its methods are idempotent reads."""


    def __init__(self, config: NodeConfig) -> None:
        self._server = self.make_server(config)
        self._address = self._server.start()

    @staticmethod
    def make_server(config: NodeConfig):
        raise NotImplementedError

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


def spawn_node(actor_cls, config: NodeConfig, *, gpu: bool = False, accelerator_type: str | None = None,
               num_cpus: float = 1):
    """Start ``actor_cls`` (a ray.remote NodeActorBody) named ``config.node_id`` in its role's pool."""
    opts = ray_actor_options(config, gpu=gpu, accelerator_type=accelerator_type, num_cpus=num_cpus)
    return actor_cls.options(**opts).remote(config)
