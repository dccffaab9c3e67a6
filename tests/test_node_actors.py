"""Prefill and decode nodes as Ray actors on a real local Ray, in their own pools: one request
through them by hand, both registered in Redis, and a restarted actor re-registers cleanly."""
from __future__ import annotations

import json
import uuid

import grpc
import pytest
import redis

from engine.engine import LLMEngine
from kv_index.reader import IndexReader
from kv_transfer.grpc_transport import KV_GRPC_OPTIONS
from protos.convert import sampling_to_proto
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from tests.helpers import node_engine_config, wait_for
from tokens.block_hash import hash_prompt_blocks
from tokens.sampling_params import SamplingParams

ray = pytest.importorskip("ray")

BS = 4  # node_engine_config's block size
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)


def run_request(prefill_addr: str, decode_addr: str, fp: str, rid: str, prompt: list[int]) -> list[int]:
    with grpc.insecure_channel(prefill_addr, options=KV_GRPC_OPTIONS) as p_ch, \
            grpc.insecure_channel(decode_addr, options=KV_GRPC_OPTIONS) as d_ch:
        res = kv_pb2_grpc.KVTransferStub(d_ch).ReserveBlocks(kv_pb2.ReserveBlocksRequest(
            request_id=rid, model_fingerprint=fp, block_size=BS, num_tokens=len(prompt),
            prompt_token_ids=prompt), timeout=30)
        pre = kv_pb2_grpc.PrefillNodeStub(p_ch).Prefill(kv_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY),
            decode_address=decode_addr, reservation=res), timeout=30)
        msgs = kv_pb2_grpc.DecodeNodeStub(d_ch).Decode(kv_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY),
            first_token_ids=pre.first_token_ids, cached_prompt_tokens=pre.cached_tokens), timeout=30)
        return [t for m in msgs if m.WhichOneof("kind") == "chunk" for t in m.chunk.token_ids]


def test_prefill_and_decode_actors_serve_a_request_and_register(tiny_dir, redis_url, local_ray):
    from tests.clusters import spawn_actor

    ns = f"ray-{uuid.uuid4().hex[:6]}"
    common = dict(redis_url=redis_url, namespace=ns, lease_s=1.0, heartbeat_s=0.2, load_tokenizer=False,
                  engine=node_engine_config(tiny_dir))
    prefill = spawn_actor("prefill", "prefill-0", num_cpus=1, **common)
    decode = spawn_actor("decode", "decode-0", num_cpus=1, **common)
    assert ray.get([prefill.ready.remote(), decode.ready.remote()], timeout=60) == [True, True]
    p_addr, d_addr = ray.get([prefill.address.remote(), decode.address.remote()], timeout=30)
    assert ray.get_actor("decode-0") is not None  # named: visible on the dashboard

    ref_engine = LLMEngine(node_engine_config(tiny_dir), load_tokenizer=False)
    prompt = list(range(20, 47))
    ref = ref_engine.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert run_request(p_addr, d_addr, ref_engine.fingerprint, "r1", prompt) == ref

    r = redis.Redis.from_url(redis_url)
    reader = IndexReader(r, ns=ns)
    live = reader.live_nodes()
    assert {n: (i.role, i.grpc_address) for n, i in live.items()} == {
        "prefill-0": ("prefill", p_addr), "decode-0": ("decode", d_addr)}
    hashes = hash_prompt_blocks(prompt, BS, ref_engine.fingerprint.encode())
    assert wait_for(lambda: reader.match(hashes, ["decode-0"])["decode-0"].blocks == len(hashes), 5, every=0.1)
    stats = ray.get(decode.stats.remote(), timeout=30)
    json.dumps(stats)  # plain data
    assert stats["free_blocks"] == stats["num_blocks"] == 64

    # Ray restarts a killed node: it comes back on a new port with a fresh pool, and its
    # registration replaces the old one, index entries included.
    old_pid = stats["pid"]

    def restarted() -> bool:
        try:  # ray.kill returns before the old process is gone: wait for the new one
            return ray.get(decode.stats.remote(), timeout=60)["pid"] != old_pid
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            return False

    ray.kill(decode, no_restart=False)
    assert wait_for(restarted, 60, every=0.1)
    assert ray.get(decode.ready.remote(), timeout=30)
    new_addr = ray.get(decode.address.remote(), timeout=30)
    assert wait_for(lambda: reader.live_nodes().get("decode-0") is not None
                    and reader.live_nodes()["decode-0"].grpc_address == new_addr, 10, every=0.1)
    assert reader.match(hashes, ["decode-0"])["decode-0"].blocks == 0
    assert run_request(p_addr, new_addr, ref_engine.fingerprint, "r2", prompt) == ref

    ray.get([prefill.stop.remote(), decode.stop.remote()], timeout=30)
    assert reader.live_nodes() == {}
    for actor in (prefill, decode):
        ray.kill(actor, no_restart=True)
    r.close()
