"""Layer-wise KV streaming, measured: `pdserve bench transfer`'s ``overlap``,
``ttft_streaming_s`` and ``ttft_after_prefill_s``.

A real prefill node and decode node (in-process ``PrefillServer`` / ``DecodeServer`` on
loopback, a private Redis for their index entries) serve a long prompt (default 2,048 tokens
of SmolLM2-135M: four chunks of 512) the way the router drives them: ReserveBlocks on the
decode node, then Prefill on the prefill node, which samples the first token and moves the KV
through the transport the decode node advertises (shm on one host). The prefill node's
streaming switch (``PrefillServer.kv_streaming``) is flipped between requests, so both ways
run in one process on the same engines, interleaved repeat by repeat, after the same warm-up;
every request's prompt is fresh (salted random tokens), so neither prefix cache hides work.

Per request, from the PrefillResponse:
- ``ttft`` = wall time of the Prefill call: first token sampled AND all KV landed on the decode
  node, which is when the router can start Decode. ``ttft_streaming_s`` is its median with
  streaming, ``ttft_after_prefill_s`` without (push after the prefill).
- ``transfer_s``: time spent pushing (without streaming: the one push after the prefill; with
  streaming: the pushes' summed wall time, mostly while the prefill computes).
- ``transfer_exposed_s``: from the compute's end (first token sampled) to the last push landed:
  the part of the transfer the request waited for.

``overlap`` = 1 - median(transfer_exposed_s with streaming) / median(transfer_s without): the
fraction of the transfer time that streaming hides behind the prefill's compute (1: none left
after the first token; 0: as exposed as pushing after the prefill). The TTFTs show what it
costs or saves end to end (on a small CPU machine the sender competes with the compute).
"""
from __future__ import annotations

import math
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import torch

# The tiny model's KV is a few KiB per block: push whatever is ready, so quick mode streams too.
QUICK = dict(model="tiny-llama", prompt_tokens=384, repeats=2, chunk=128, min_push_bytes=0)
FULL = dict(model="smollm2-135m", prompt_tokens=2048, repeats=5, chunk=512, min_push_bytes=None)
BLOCK_SIZE = 16


def measure(report, *, model: str, prompt_tokens: int, repeats: int, chunk: int, quick: bool,
            min_push_bytes: int | None = None) -> dict:
    """``min_push_bytes``: the prefill node's KV_STREAM_MIN_PUSH_BYTES (None: its default)."""
    from bench.bench_models import bench_model_dir
    from decode_node.server import DecodeServer
    from deploy.redis_server import RedisServer
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from kv_transfer.grpc_transport import KV_GRPC_OPTIONS
    from node.config import NodeConfig
    from prefill_node.server import PrefillServer
    from protos.convert import sampling_to_proto
    from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
    from tokens.block_hash import hash_prompt_blocks
    from tokens.sampling_params import SamplingParams

    blocks = math.ceil(prompt_tokens / BLOCK_SIZE)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp, RedisServer(password="") as redis_server:
        tiny = dict(num_hidden_layers=4, max_position_embeddings=2 * prompt_tokens) if model.startswith("tiny-") else {}
        model_dir = bench_model_dir(model, Path(tmp), progress=report.progress, **tiny)
        engine = EngineConfig(model=str(model_dir), dtype="float32", device="cpu",
                              cpu_kernels="torch" if quick else "auto",
                              cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=2 * blocks + 16),
                              scheduler=SchedulerConfig(max_num_batched_tokens=chunk))
        ns = f"bench-{uuid.uuid4().hex[:8]}"
        common = dict(redis_url=redis_server.url, namespace=ns, load_tokenizer=False, metrics_port=None, engine=engine)
        report.progress(f"loading {model} on a prefill and a decode node (in this process)")
        prefill = PrefillServer(NodeConfig(node_id="bench-prefill", role="prefill", **common))
        # A 2k prefill on a small CPU outlasts the default lease, which a router would renew.
        decode = DecodeServer(NodeConfig(node_id="bench-decode", role="decode", reservation_lease_s=600, **common))
        if min_push_bytes is not None:
            prefill.kv_stream_min_push_bytes = min_push_bytes
        nodes, channels = [], []
        try:
            for node in (prefill, decode):
                node.start()
                nodes.append(node)
            p_ch = grpc.insecure_channel(prefill.address, options=KV_GRPC_OPTIONS)
            d_ch = grpc.insecure_channel(decode.address, options=KV_GRPC_OPTIONS)
            channels += [p_ch, d_ch]
            prefill_stub, kv_stub = kv_pb2_grpc.PrefillNodeStub(p_ch), kv_pb2_grpc.KVTransferStub(d_ch)
            fp = prefill.engine.fingerprint
            vocab = prefill.engine.model_config.vocab_size
            params = sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=1))
            gen = torch.Generator().manual_seed(0)

            def one(streaming: bool, tag: str) -> dict:
                # Fresh random tokens: no prefix cache on either node holds any of them.
                prompt = torch.randint(3, vocab, (prompt_tokens,), generator=gen).tolist()
                rid = f"{tag}-{'on' if streaming else 'off'}"
                res = kv_stub.ReserveBlocks(kv_pb2.ReserveBlocksRequest(
                    request_id=rid, model_fingerprint=fp, block_size=BLOCK_SIZE, num_tokens=len(prompt),
                    block_hashes=hash_prompt_blocks(prompt, BLOCK_SIZE, fp.encode()), prompt_token_ids=prompt),
                    timeout=60)
                prefill.kv_streaming = streaming
                t0 = time.perf_counter()
                pre = prefill_stub.Prefill(kv_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=params, decode_address=decode.address,
                    reservation=res), timeout=600)
                ttft = time.perf_counter() - t0
                # The KV is not used further: hand the blocks back (no Decode).
                kv_stub.ReleaseReservation(kv_pb2.ReleaseReservationRequest(request_id=rid), timeout=60)
                return {"ttft_s": ttft, "prefill_s": pre.prefill_s, "transfer_s": pre.transfer_s,
                        "exposed_s": pre.transfer_exposed_s, "pushes": pre.kv_pushes, "transport": pre.transport,
                        "bytes": pre.bytes_sent, "streamed": pre.kv_streamed}

            for streaming in (False, True):  # the same warm-up both ways
                one(streaming, "warmup")
            runs: dict[bool, list[dict]] = {False: [], True: []}
            for i in range(repeats):
                # Alternate which goes first, so neither always runs right after the other.
                for streaming in ((False, True) if i % 2 == 0 else (True, False)):
                    r = one(streaming, f"r{i}")
                    runs[streaming].append(r)
                    report.progress(f"repeat {i} streaming {'on ' if streaming else 'off'}: ttft {r['ttft_s']:.3f}s "
                                    f"(prefill {r['prefill_s']:.3f}s, transfer {r['transfer_s'] * 1e3:.1f} ms in "
                                    f"{r['pushes']} pushes, exposed {r['exposed_s'] * 1e3:.1f} ms, {r['transport']})")
        finally:
            for ch in channels:
                ch.close()
            for node in nodes:
                node.stop(deregister=False)

    def med(streaming: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs[streaming])

    on, off = runs[True], runs[False]
    overlap = 1 - med(True, "exposed_s") / med(False, "transfer_s")
    return {
        "overlap": round(overlap, 3),
        "ttft_streaming_s": round(med(True, "ttft_s"), 4),
        "ttft_after_prefill_s": round(med(False, "ttft_s"), 4),
        "streaming": {
            "model": model, "prompt_tokens": prompt_tokens, "chunk_tokens": chunk, "repeats": repeats,
            "kv_bytes": off[0]["bytes"], "transport": on[0]["transport"],
            "on": {"ttft_s": round(med(True, "ttft_s"), 4), "prefill_s": round(med(True, "prefill_s"), 4),
                   "transfer_s": round(med(True, "transfer_s"), 4), "exposed_s": round(med(True, "exposed_s"), 4),
                   "pushes": statistics.median(r["pushes"] for r in on)},
            "off": {"ttft_s": round(med(False, "ttft_s"), 4), "prefill_s": round(med(False, "prefill_s"), 4),
                    "transfer_s": round(med(False, "transfer_s"), 4), "exposed_s": round(med(False, "exposed_s"), 4),
                    "pushes": statistics.median(r["pushes"] for r in off)},
            "all_streamed": all(r["streamed"] for r in on) and not any(r["streamed"] for r in off),
        },
    }
