"""What a node actor runs: the server factory `pdserve up` (deploy/launcher.py), `pdserve nodes`
(deploy/nodes.py) and the pool controller's spawns (deploy/pool_runners.py) hand to
``spawn_node``."""
from __future__ import annotations

from kv_index.nodes import Role
from node.config import NodeConfig


def server_builder(role: Role, backend: str = "pdserve"):
    """What a node actor of ``role`` runs: ``build_any_role``, which builds ``role``'s server at
    start and the other role's over the same engine when the node switches live; with the vLLM
    backend, ``build_vllm_node`` (decode only, no live switch)."""
    Role(role)  # a bad name fails here, in the driver
    if backend == "vllm":
        if Role(role) is not Role.DECODE:
            raise ValueError("--engine vllm runs decode nodes only (they prefill their own prompts): use "
                             "--prefill-nodes 0; vLLM prefill nodes need the KV connector (issue 46, section 2)")
        return build_vllm_node
    return build_any_role


def build_any_role(config: NodeConfig, engine=None):
    """The server of ``config.role`` from its role package's ``build_server`` (over ``engine``
    when given: node/role_switch.py)."""
    import decode_node
    import prefill_node

    build = prefill_node.build_server if Role(config.role) is Role.PREFILL else decode_node.build_server
    return build(config, engine)


build_any_role.roles = (Role.PREFILL, Role.DECODE)  # the roles a node actor may switch between


def build_vllm_node(config: NodeConfig, engine=None):
    """A decode node whose engine is vLLM in a child process (decode_node/vllm_server.py)."""
    from decode_node.vllm_server import build_server

    return build_server(config, engine)


build_vllm_node.roles = (Role.DECODE,)  # a switch to prefill is refused, not attempted
