"""The prefill node's server: PrefillNode.Prefill on the shared node base (node/server.py).

Prefill = the request run with max_tokens=1 and its KV held after it finishes, then the blocks
the decode node does not already hold pushed into its reservation, then the blocks released::

    prompt blocks here:  [ p0 p1 | p2 p3 p4 ]     reservation.num_cached_blocks = 2
                           held    pushed -> reservation.block_ids

The first token is sampled here with the request's own sampling parameters (seed,
temperature, penalties...), so it follows the same distribution as on a single engine; the
decode node continues from it. Stop strings are left to the decode node, which detokenizes.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time

import grpc
from opentelemetry.trace import SpanKind

from engine.engine import LLMEngine, RequestOutput
from engine.errors import InvalidRequestError
from kv_index.nodes import Role, StepReport
from kv_transfer.grpc_transport import GrpcKVSender
from kv_transfer.shm_transport import ShmKVSender
from kv_transfer.tcp_transport import TcpKVSender
from kv_transfer.transport import FallbackKVSender, KVSender, PushResult, TransferError
from node.config import NodeConfig
from node.engine_thread import EngineStoppedError, RequestFailedError
from node.rpc_trace import child_span, prefill_phases, traced_rpc
from node.server import NodeServer
from protos.convert import sampling_from_proto, token_logprobs_to_proto
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from telemetry import tracing
from telemetry.metrics import RequestRecorder
from tokens.block_hash import hash_prompt_blocks
from tokens.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# A push that takes longer is treated as a failed transfer (the router then recomputes).
PUSH_TIMEOUT_S = 60.0


class PrefillServer(NodeServer):
    role = Role.PREFILL
    services = (kv_pb2.DESCRIPTOR.services_by_name["PrefillNode"].full_name,)
    long_methods = ("/pdserve.v1.PrefillNode/Prefill",)

    def __init__(self, config: NodeConfig, engine: LLMEngine | None = None,
                 kv_sender: KVSender | None = None) -> None:
        # Prefill nodes never detokenize: the decode node streams the text.
        super().__init__(config, engine or LLMEngine(config.engine, load_tokenizer=False))
        # The decode node's advertised transports in its order (shared memory on the same host,
        # then raw TCP; both plaintext, so only without TLS), then gRPC (docs/cluster.md,
        # "KV data plane").
        fast = [ShmKVSender(), TcpKVSender()] if config.tls is None else []
        self.kv_sender = kv_sender or FallbackKVSender(fast, GrpcKVSender(config.tls))
        self._healthy_sender: KVSender | None = None  # kept while a KV fault is injected
        kv_pb2_grpc.add_PrefillNodeServicer_to_server(_PrefillService(self), self.grpc_server)
        self.num_prefills = 0
        self.num_transfer_failures = 0
        # Prefills in progress on this node: a step report is only clean (pure compute, no
        # queueing behind another request) when its prefill ran alone.
        self._inflight = 0
        self._starts = 0
        self._inflight_lock = threading.Lock()

    def stop(self, deregister: bool = True, grace_s: float = 1.0) -> None:
        super().stop(deregister=deregister, grace_s=grace_s)
        self.set_kv_fault(None)
        self.kv_sender.close()

    def set_kv_fault(self, mode: str | None) -> None:
        """Fault injection (prefill_node/faults.py): damage every KV push from now on ("flip",
        "cut"), or send normally again (None). Called in this process only (the node actor's
        ``set_kv_fault``, tests); nothing on the wire reaches it."""
        from prefill_node.faults import CorruptingKVSender

        if self._healthy_sender is not None:
            self.kv_sender.close()
            self.kv_sender, self._healthy_sender = self._healthy_sender, None
        if mode is not None:
            self._healthy_sender, self.kv_sender = self.kv_sender, CorruptingKVSender(mode, self.config.tls)

    def role_stats(self) -> dict:
        return {"prefills": self.num_prefills, "transfer_failures": self.num_transfer_failures,
                "prefills_in_progress": self._inflight}


def first_token_params(params: SamplingParams, resumed: int = 0) -> SamplingParams:
    """The request's parameters for sampling its first token here only: same distribution
    (min_tokens still bans EOS), one token, no stop strings (no text here). ``resumed``: output
    tokens already produced (a migrated request), so the one sampled here is number
    ``resumed`` and max_tokens / min_tokens count them too."""
    return dataclasses.replace(params, max_tokens=resumed + 1, min_tokens=min(params.min_tokens, resumed + 1),
                               stop=(), include_stop_str_in_output=False)


class _PrefillService(kv_pb2_grpc.PrefillNodeServicer):
    def __init__(self, node: PrefillServer) -> None:
        self.node = node

    @traced_rpc("prefill_node.Prefill", lambda r: {
        tracing.REQUEST_ID: r.request_id, tracing.GEN_AI_USAGE_INPUT_TOKENS: len(r.prompt_token_ids),
        "pdserve.decode_address": r.decode_address})
    def Prefill(self, request: kv_pb2.PrefillRequest, context: grpc.ServicerContext):
        node, eng = self.node, self.node.engine
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        params = sampling_from_proto(request.sampling)
        problem = _prefill_problem(rid, prompt, params, request, eng)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        node.admit(context)
        t0 = time.monotonic()
        # This node's part of the request: arrival -> first token (ttft) -> KV pushed (e2e).
        rec = RequestRecorder(node.metrics.requests, arrival=t0)
        try:
            resumed = request.resumed_output_tokens
            stream = node.aengine.add_request(prompt, first_token_params(params, resumed), request_id=rid,
                                              hold_kv=True, resumed_output_tokens=resumed)
        except InvalidRequestError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except EngineStoppedError as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        with node._inflight_lock:
            node._inflight += 1
            node._starts += 1
            alone, starts = node._inflight == 1, node._starts
        context.add_callback(stream.cancel)  # the router gave up: stop computing
        try:
            try:
                final = self._wait(stream, context)
            finally:
                with node._inflight_lock:
                    node._inflight -= 1
                    alone = alone and node._starts == starts  # nobody started meanwhile
            prefill_s = time.monotonic() - t0
            prefill_phases(t0, final)
            rec.scheduled(final.metrics.first_scheduled_time)
            rec.sample(0, len(final.outputs[0].token_ids), now=t0 + prefill_s)
            if alone and node.publisher is not None:
                node.publisher.submit_step(StepReport(
                    new_tokens=len(prompt) - final.num_cached_tokens, context_tokens=len(prompt),
                    seconds=prefill_s))
            blocks_sent = bytes_sent = 0
            transport = ""
            t1 = time.monotonic()
            if request.reservation.block_ids:
                with child_span("kv_transfer.push", context, {
                        "pdserve.decode_address": request.decode_address,
                        tracing.KV_CACHED_BLOCKS: request.reservation.num_cached_blocks}, SpanKind.CLIENT) as span:
                    pushed = self._push(rid, prompt, request, context)
                    blocks_sent, bytes_sent, transport = pushed
                    # The receiver takes nothing unless every checksum matched: a push that
                    # returns was verified.
                    span.set_attributes({tracing.KV_BLOCKS: blocks_sent, tracing.KV_BYTES: bytes_sent,
                                         tracing.KV_TRANSFER_S: time.monotonic() - t1,
                                         tracing.KV_CHECKSUM_VERIFIED: True,
                                         "pdserve.kv.transport": transport})
            transfer_s = time.monotonic() - t1 if request.reservation.block_ids else 0.0
            if request.reservation.block_ids:
                node.metrics.transfer_bytes.inc(bytes_sent)
                node.metrics.transfer_seconds.observe(transfer_s)
        finally:
            # Always: the blocks stay in this node's prefix cache either way, unpinned.
            try:
                node.aengine.release_kv(rid)
            except EngineStoppedError:
                pass  # the engine and its blocks are gone with it
        node.num_prefills += 1
        # The request leaves this node here: "prefilled", whatever the decode node makes of it.
        rec.sample(0, 0, "prefilled")
        rec.finish(len(prompt))
        c = final.outputs[0]
        first = c.token_ids[request.resumed_output_tokens:]  # a resumed request's earlier outputs are known
        first_logprobs = token_logprobs_to_proto(first[:1], c.logprobs and c.logprobs[:1],
                                                 c.new_top_logprobs and c.new_top_logprobs[:1])
        return kv_pb2.PrefillResponse(
            first_token_ids=first, first_logprobs=first_logprobs, cached_tokens=final.num_cached_tokens,
            blocks_sent=blocks_sent, bytes_sent=bytes_sent,
            prefill_s=prefill_s, transfer_s=transfer_s, transport=transport,
        )

    def _wait(self, stream, context) -> RequestOutput:
        try:
            final = stream.result()
        except RequestFailedError as err:
            context.abort(grpc.StatusCode.INTERNAL, str(err))
        except EngineStoppedError as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        if final.outputs[0].finish_reason == "abort" or not final.outputs[0].token_ids:
            context.abort(grpc.StatusCode.CANCELLED, f"request {final.request_id!r} was aborted")
        return final

    def _push(self, rid: str, prompt: list[int], request: kv_pb2.PrefillRequest, context) -> PushResult:
        node, eng = self.node, self.node.engine
        res = request.reservation
        bs = eng.block_size
        # The table may run past the prompt (the sampled token's slot): only prompt blocks go.
        src = node.aengine.held_block_table(rid)[: math.ceil(len(prompt) / bs)]
        try:
            return node.kv_sender.push(
                request.decode_address, eng.kv_cache,
                request_id=rid, fingerprint=eng.fingerprint, src_block_ids=src,
                block_hashes=hash_prompt_blocks(prompt, bs, eng.fingerprint.encode()),
                num_tokens=len(prompt), dest_block_ids=list(res.block_ids),
                skip_leading_blocks=res.num_cached_blocks, timeout=PUSH_TIMEOUT_S,
                endpoints=tuple(res.kv_endpoints),
            )
        except ValueError as err:  # the reservation does not fit this prompt
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"reservation: {err}")
        except TransferError as err:
            node.num_transfer_failures += 1
            node.metrics.transfer_failures.inc()
            log.warning("KV transfer of %r to %s failed: %s", rid, request.decode_address, err)
            # The receiver's code (INVALID_ARGUMENT, DATA_LOSS, NOT_FOUND) or UNAVAILABLE /
            # DEADLINE_EXCEEDED when it could not be reached: the router recomputes on decode.
            context.abort(err.code, f"KV transfer to {request.decode_address} failed: {err.details}")


def _prefill_problem(rid: str, prompt: list[int], params: SamplingParams, request, eng: LLMEngine) -> str:
    """Why this prefill can never lead to a served request ("" if it can). The whole request
    is checked, not just its first token, so a bad one fails before any compute or transfer."""
    if not rid:
        return "request_id is required"
    if params.n != 1:
        return f"a disaggregated prefill samples one sequence: n must be 1, got {params.n}"
    if request.reservation.block_ids and not request.decode_address:
        return "decode_address is required when the reservation lists blocks to send"
    try:
        params.validate(eng.model_config.vocab_size)
    except ValueError as err:
        return str(err)
    resumed = request.resumed_output_tokens
    if resumed and not (resumed < len(prompt) and resumed < params.max_tokens):
        return (f"resumed_output_tokens ({resumed}) must be below the prompt's length ({len(prompt)}) and "
                f"max_tokens ({params.max_tokens})")
    if prompt and len(prompt) - resumed + params.max_tokens > eng.max_model_len:
        return (f"prompt ({len(prompt) - resumed} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {eng.max_model_len} tokens")
    return ""
