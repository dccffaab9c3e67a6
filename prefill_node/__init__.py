"""Prefill role: a node that prefills prompts and streams their KV to decode nodes.

Only what differs from a decode node lives here (its server, server.py); the rest is node/.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node.config import NodeConfig
    from prefill_node.server import PrefillServer


def build_server(config: NodeConfig, engine=None) -> PrefillServer:
    """The role's server, for ``node.actor.spawn_node`` (called in the node's own process, so
    torch and the model load there). ``engine``: one already loaded (a live role switch,
    node/role_switch.py); None loads the model."""
    from prefill_node.server import PrefillServer

    return PrefillServer(config, engine=engine)
