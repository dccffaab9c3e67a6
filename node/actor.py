"""A serving node as a Ray actor, whatever its role.

Ray places, restarts and names the node; gRPC carries everything else (no tensors through
Ray). A restarted actor builds a fresh engine and registers again, which drops whatever its
previous life published to the index (NodePublisher.register).

The role's server comes from ``build_server``, a module-level function of the role's package
(``prefill_node.build_server``, ``decode_node.build_server``). Ray ships it by reference and the
actor calls it in its own process, so torch and the model load there, never in the driver.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

from node.config import NodeConfig, ray_actor_options

if TYPE_CHECKING:  # the server module loads torch: only the actor's process imports it
    from node.server import NodeServer

ServerFactory = Callable[[NodeConfig], "NodeServer"]


@ray.remote
class NodeActor:
    """Starts the role's server in the actor process; its methods are idempotent reads."""

    def __init__(self, config: NodeConfig, build_server: ServerFactory) -> None:
        self._server = build_server(config)
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


def spawn_node(config: NodeConfig, build_server: ServerFactory, *, gpu: bool = False,
               accelerator_type: str | None = None, num_cpus: float = 1):
    """Start a node actor named ``config.node_id`` in its role's pool; returns its handle."""
    opts = ray_actor_options(config, gpu=gpu, accelerator_type=accelerator_type, num_cpus=num_cpus)
    return NodeActor.options(**opts).remote(config, build_server)
