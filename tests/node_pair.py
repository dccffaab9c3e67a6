"""A prefill node and a decode node in this process (no Ray, no router), driven by hand over real
gRPC the way the router drives them: ``NodePair``. tests/test_nodes.py (``Cluster``, which
other modules import) and tests/test_node_metrics.py (``Pair``) subclass it."""
from __future__ import annotations

import uuid

import grpc
import redis

from kv_index.reader import IndexReader
from kv_transfer.grpc_transport import KV_GRPC_OPTIONS
from protos.convert import sampling_to_proto
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc, serving_pb2
from tests.clusters import start_node
from tokens.block_hash import hash_prompt_blocks


class NodePair:
    """Prefill node ``p0`` and decode node ``d0`` on a private namespace ``prefix-…`` (leases of
    ``lease_s``, heartbeats every 0.1 s; ``node_fields``: other NodeConfig fields), a channel and
    stubs for each, and a Redis client and index reader on the namespace. Each engine is an
    EngineConfig or an LLMEngine already built (``start_node``)."""

    def __init__(self, prefill_engine, decode_engine, redis_url: str, *, prefix: str, lease_s: float = 1.0,
                 **node_fields) -> None:
        self.ns = f"{prefix}-{uuid.uuid4().hex[:8]}"
        kw = dict(redis_url=redis_url, namespace=self.ns, lease_s=lease_s, heartbeat_s=0.1)
        kw.update(node_fields)
        self.prefill = start_node("prefill", "p0", prefill_engine, **kw)
        self.decode = start_node("decode", "d0", decode_engine, **kw)
        self.p_channel = grpc.insecure_channel(self.prefill.address, options=KV_GRPC_OPTIONS)
        self.d_channel = grpc.insecure_channel(self.decode.address, options=KV_GRPC_OPTIONS)
        self.prefill_stub = kv_pb2_grpc.PrefillNodeStub(self.p_channel)
        self.kv_stub = kv_pb2_grpc.KVTransferStub(self.d_channel)
        self.decode_stub = kv_pb2_grpc.DecodeNodeStub(self.d_channel)
        self.redis = redis.Redis.from_url(redis_url)
        self.reader = IndexReader(self.redis, ns=self.ns)
        self.fp = self.decode.engine.fingerprint
        self.block_size = self.decode.engine.block_size

    def close(self) -> None:
        self.p_channel.close()
        self.d_channel.close()
        for node in (self.prefill, self.decode):
            if node.aengine.alive:
                node.stop()
        self.redis.close()

    def hashes(self, prompt):
        return hash_prompt_blocks(prompt, self.block_size, self.fp.encode())

    def reserve(self, rid, prompt) -> kv_pb2.ReserveBlocksResponse:
        return self.kv_stub.ReserveBlocks(kv_pb2.ReserveBlocksRequest(
            request_id=rid, model_fingerprint=self.fp, block_size=self.block_size, num_tokens=len(prompt),
            block_hashes=self.hashes(prompt), prompt_token_ids=prompt), timeout=10)

    def prefill_rpc(self, rid, prompt, params, reservation) -> kv_pb2.PrefillResponse:
        return self.prefill_stub.Prefill(kv_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params),
            decode_address=self.decode.address, reservation=reservation), timeout=30)

    def decode_rpc(self, rid, prompt, params, first=(), cached=0) -> list[serving_pb2.GenerateResponse]:
        return list(self.decode_stub.Decode(kv_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params),
            first_token_ids=list(first), cached_prompt_tokens=cached), timeout=30))

    def disaggregated(self, rid, prompt, params):
        """Reserve, prefill, decode: (the reservation, the prefill's response, the decode stream)."""
        res = self.reserve(rid, prompt)
        pre = self.prefill_rpc(rid, prompt, params, res)
        msgs = self.decode_rpc(rid, prompt, params, pre.first_token_ids, pre.cached_tokens)
        return res, pre, msgs

    @staticmethod
    def free_blocks(node) -> int:
        return node.aengine.run(lambda e: e.kv.num_free_blocks)
