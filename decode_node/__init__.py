"""Decode role: a node that receives prompt KV, decodes (with speculation, spec/) and streams
tokens back.

Only what differs from a prefill node lives here; the rest is node/.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decode_node.server import DecodeServer
    from node.config import NodeConfig


def build_server(config: NodeConfig, engine=None) -> DecodeServer:
    """The role's server, for ``node.actor.spawn_node`` (called in the node's own process, so
    torch and the model load there). ``engine``: one already loaded (a live role switch,
    node/role_switch.py); None loads the model."""
    from decode_node.server import DecodeServer

    return DecodeServer(config, engine=engine)
