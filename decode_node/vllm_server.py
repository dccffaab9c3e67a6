"""The decode role over a vLLM engine (``--engine vllm``): the same node as DecodeServer (node
base, Decode stream, AbortDecode, health, drain, metrics, registration) except that its engine is
``node.vllm_engine.VllmEngine`` and it receives no KV.

It prefills every prompt itself: the router places a request whole on it when no prefill node
is live (``--prefill-nodes 0``: placement's "local" path, a Decode without first tokens). It
serves no KVTransfer service, so a ReserveBlocks from a router that does see prefill nodes
gets UNIMPLEMENTED and the router prefills on this node instead (router/orchestrator.py). Its
fingerprint says ``vllm``: vLLM's KV layout is not pdserve's, so the router never mixes its
blocks with a pdserve node's (router/node_view.py keeps one fingerprint per view).
"""
from __future__ import annotations

from decode_node.server import _DecodeService
from engine.models.loader import checkpoint_fingerprint
from kv_index.nodes import Role
from node.config import NodeConfig
from node.server import NodeServer
from node.vllm_engine import VllmEngine
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc


class _NoReservations:
    """A vLLM node holds none: every Decode is a request it prefills itself."""

    def get(self, request_id: str):
        return None

    def ids(self) -> list[str]:
        return []

    def __len__(self) -> int:
        return 0


class _VllmDecodeService(_DecodeService):
    def _add_prefilled(self, request, prompt, params, context):
        import grpc

        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"node {self.node.config.node_id} runs vLLM and takes no prefilled KV: send the Decode "
                      "without first_token_ids (it prefills the prompt itself)")


def build_vllm_engine(config: NodeConfig) -> VllmEngine:
    eng = config.engine
    _, fp = checkpoint_fingerprint(eng.model)
    return VllmEngine(eng.model, dtype=eng.dtype, seed=eng.seed, max_model_len=eng.scheduler.max_model_len,
                      kv_cache_bytes=eng.cache.kv_cache_bytes,
                      python=eng.vllm_python, fingerprint=f"vllm-{fp}-{eng.dtype}",
                      env=_thread_env(eng.num_threads, config.cpu_affinity))


def _thread_env(threads: int | None, affinity) -> dict[str, str]:
    """vLLM's CPU threads: by default it keeps a core back for itself and binds the rest; a node
    gets what it was given (its pinned cores, else vLLM's own binding over the node's cores)."""
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if affinity:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(affinity)))
        env["OMP_NUM_THREADS"] = str(len(affinity))
    return env


class VllmDecodeServer(NodeServer):
    role = Role.DECODE
    services = (kv_pb2.DESCRIPTOR.services_by_name["DecodeNode"].full_name,)
    long_methods = ("/pdserve.v1.DecodeNode/Decode",)

    def __init__(self, config: NodeConfig, engine: VllmEngine | None = None) -> None:
        super().__init__(config, engine or build_vllm_engine(config))
        self.reservations = _NoReservations()
        kv_pb2_grpc.add_DecodeNodeServicer_to_server(_VllmDecodeService(self), self.grpc_server)
        self.num_decodes = 0

    def drop_reservation(self, request_id: str) -> tuple[bool, bool]:
        return False, False

    def role_stats(self) -> dict:
        stats = self._engine_stats() or self.engine.stats()
        return {"reservations": 0, "speculative": None, "transfer_failures": 0, "decodes": self.num_decodes,
                "engine_backend": "vllm", "vllm_pid": stats.get("vllm_pid"),
                "vllm_version": stats.get("vllm_version")}


def build_server(config: NodeConfig, engine=None) -> VllmDecodeServer:
    """A vLLM node's server (decode role only; a live role switch is refused: deploy/node_servers.py)."""
    if Role(config.role) is not Role.DECODE:
        raise ValueError(f"--engine vllm serves decode nodes only (they prefill their own prompts), got role "
                         f"{config.role.value!r}; vLLM prefill nodes need the KV connector (issue 46, section 2)")
    return VllmDecodeServer(config, engine)
