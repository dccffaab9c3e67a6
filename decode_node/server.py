"""The decode node's server: KVTransfer (reserve, receive, release) and DecodeNode (Decode
stream, AbortDecode) on the shared node base (node/server.py).

A disaggregated request, as seen from here::

    ReserveBlocks   blocks for the prompt; leading ones this node already caches are kept and
                    not sent (num_cached_blocks); the rest are promised to the prefill node
    PushBlocks      the prefill node writes the KV into exactly those blocks (validated first)
    Decode          with first_token_ids: the request joins the running batch over that KV;
                    without: this node prefills the prompt itself (short prompt, or recompute
                    after a failed transfer; any leftover reservation is dropped first);
                    a silent stream gets a Heartbeat every heartbeat_s the router asked for,
                    while the engine loop moves (AsyncEngine.progress)

Writing into reserved blocks from a gRPC thread while the engine loop steps is safe: the
engine never reads or reuses a block that is reserved but not yet added as a request, and a
reservation's blocks go back to the engine only once no push into them is in flight.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import grpc

from decode_node.responses import ResponseBuilder
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.speculative.proposers import build_proposer
from kv_index.nodes import Role
from kv_transfer.validate import Reservation, new_token
from node.config import NodeConfig
from node.engine_thread import EngineStoppedError, OutputStream, RequestFailedError
from node.kv_inbox import KVInbox
from node.reservations import NotReadyError
from node.rpc_trace import DecodeStreamTrace, traced_rpc
from node.server import Handover, NodeServer
from node.tp_engine import build_engine, tp_landing
from protos.conventions import retry_after_metadata
from protos.convert import sampling_from_proto
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc, serving_pb2
from telemetry import tracing
from telemetry.request_recorder import RequestRecorder
from tokens.block_hash import hash_prompt_blocks

log = logging.getLogger(__name__)

# Told to a router whose ReserveBlocks found the pool full: blocks free up as requests finish.
RETRY_AFTER_MS = 200
# The shortest heartbeat period a router may ask for (DecodeRequest.heartbeat_s).
MIN_HEARTBEAT_S = 0.05


class DecodeServer(NodeServer):
    role = Role.DECODE
    services = tuple(kv_pb2.DESCRIPTOR.services_by_name[n].full_name for n in ("KVTransfer", "DecodeNode"))
    long_methods = ("/pdserve.v1.DecodeNode/Decode", "/pdserve.v1.KVTransfer/PushBlocks")

    def __init__(self, config: NodeConfig, engine: LLMEngine | None = None) -> None:
        # Speculation lives with the decode role: the engine gets its proposer from here.
        # Tensor parallel (config.tensor_parallel > 1): over its ranks, without speculation.
        super().__init__(config, engine or build_engine(config, load_tokenizer=config.load_tokenizer,
                                                        proposer_factory=build_proposer))
        # Its reservations and both receivers (node/kv_inbox.py): the prompts prefill nodes push
        # here, and the prefixes it fetches like any node.
        self.inbox = KVInbox(config, self.engine.kv_cache, self.engine.fingerprint, self.engine.model_config.num_layers,
                             release=lambda rid: self.aengine.release_kv(rid), on_outcome=self.record_push,
                             landing=tp_landing(self.tp, self.engine))
        self.reservations = self.inbox.reservations
        self.data_server = self.inbox.data_server
        kv_pb2_grpc.add_KVTransferServicer_to_server(_KVTransferService(self), self.grpc_server)
        kv_pb2_grpc.add_DecodeNodeServicer_to_server(_DecodeService(self), self.grpc_server)
        self.num_transfer_failures = 0  # pushes refused or broken off (also on /metrics)
        self.num_decodes = 0  # Decode calls admitted: where the router placed requests (pdserve chaos)

    def start(self, handover: Handover | None = None) -> str:
        self.inbox.start()  # the data port listens before the index advertises it
        return super().start(handover)

    def stop(self, deregister: bool = True, grace_s: float = 1.0) -> None:
        super().stop(deregister=deregister, grace_s=grace_s)
        self.inbox.stop()

    def kv_endpoints(self) -> tuple[str, ...]:
        """The data plane beside PushBlocks, fastest first: the index entry and every
        reservation carry it (docs/cluster.md, "KV data plane")."""
        return self.inbox.kv_endpoints()

    def idle(self) -> bool:
        # A reservation is an accepted request whose KV or Decode is still to come.
        return len(self.reservations) == 0

    def role_stats(self) -> dict:
        # The loop's cached stats once it runs: LLMEngine.stats() belongs to the engine thread.
        stats = self._engine_stats() or self.engine.stats()
        return {"reservations": len(self.reservations), "speculative": stats["speculative"],
                "transfer_failures": self.num_transfer_failures, "decodes": self.num_decodes}

    # ---- reservation plumbing (gRPC threads)
    def drop_reservation(self, request_id: str) -> tuple[bool, bool]:
        """Forget ``request_id``'s reservation -> (found, released now) (``KVInbox.drop``)."""
        return self.inbox.drop(request_id)

    def record_push(self, ok: bool, nbytes: int, seconds: float) -> None:
        """Count one finished KV push, over either data plane (PushBlocks or the raw TCP
        stream): bytes and time on /metrics when it landed, a transfer failure (metrics and
        ``stats``) when it was refused or broken off."""
        if ok:
            self.metrics.transfer_bytes.inc(nbytes)
            self.metrics.transfer_seconds.observe(seconds)
        else:
            self.metrics.transfer_failures.inc()
            self.num_transfer_failures += 1


class _KVTransferService(kv_pb2_grpc.KVTransferServicer):
    def __init__(self, node: DecodeServer) -> None:
        self.node = node

    @traced_rpc("decode_node.ReserveBlocks", lambda r: {
        tracing.REQUEST_ID: r.request_id, tracing.GEN_AI_USAGE_INPUT_TOKENS: len(r.prompt_token_ids)})
    def ReserveBlocks(self, request: kv_pb2.ReserveBlocksRequest, context: grpc.ServicerContext):
        node, eng = self.node, self.node.engine
        rid = request.request_id
        if request.model_fingerprint != eng.fingerprint or request.block_size != eng.block_size:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this node serves model {eng.fingerprint!r} with block_size {eng.block_size}; "
                          f"got {request.model_fingerprint!r} / {request.block_size}")
        prompt = list(request.prompt_token_ids)
        bs = eng.block_size
        problem = _reserve_problem(rid, prompt, request, eng)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        node.admit(context)  # a reservation is a new request here
        hashes = hash_prompt_blocks(prompt, bs, eng.fingerprint.encode(), salt=request.cache_salt)
        if request.block_hashes and list(request.block_hashes) != hashes[: len(request.block_hashes)]:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "block_hashes do not match the prompt's chained hashes for this model")
        try:
            got = node.aengine.reserve_kv(rid, prompt, request.cache_salt)
        except InvalidRequestError as err:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(err))
        except EngineStoppedError as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        if got is None:
            load = node.aengine.load
            context.set_trailing_metadata(retry_after_metadata(RETRY_AFTER_MS))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"no room for {math.ceil(len(prompt) / bs)} KV blocks now "
                          f"({load.free_blocks} of {load.num_blocks} free); retry in {RETRY_AFTER_MS} ms")
        table, cached_tokens = got
        first = cached_tokens // bs
        dest = table[first : math.ceil(len(prompt) / bs)]
        # The token is what lets only the prefill node this reservation is for push into it
        # (kv_transfer/validate.py, check_token); it travels to it inside PrefillRequest.
        # The ids the sender writes: these blocks, or a TP node's landing slots (kv_regroup.py LandingArea).
        wire = node.inbox.wire_blocks(rid, dest)
        if wire is None:
            node.aengine.release_kv(rid)
            context.set_trailing_metadata(retry_after_metadata(RETRY_AFTER_MS))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"no room for {len(dest)} KV blocks in the tensor-parallel landing area now "
                          f"({node.inbox.landing.free_slots} free); retry in {RETRY_AFTER_MS} ms")
        dest = list(wire)
        token = new_token()
        node.reservations.add(rid, Reservation(first, tuple(dest), tuple(hashes[first:]), token), tuple(prompt))
        tracing.annotate({tracing.KV_CACHED_BLOCKS: first, tracing.KV_BLOCKS: len(dest)})
        return kv_pb2.ReserveBlocksResponse(num_cached_blocks=first, block_ids=dest,
                                            lease_s=node.config.reservation_lease_s,
                                            kv_endpoints=node.kv_endpoints(), token=token)

    def PushBlocks(self, request_iterator, context: grpc.ServicerContext):
        return self.node.inbox.PushBlocks(request_iterator, context)

    def ReleaseReservation(self, request: kv_pb2.ReleaseReservationRequest, context):
        found, _ = self.node.drop_reservation(request.request_id)
        return kv_pb2.ReleaseReservationResponse(found=found)

    def RenewReservation(self, request: kv_pb2.RenewReservationRequest, context):
        found = self.node.reservations.renew(request.request_id)
        return kv_pb2.RenewReservationResponse(found=found, lease_s=self.node.config.reservation_lease_s)


def _reserve_problem(rid: str, prompt: list[int], request: kv_pb2.ReserveBlocksRequest, eng: LLMEngine) -> str:
    """Why a reservation can never be served ("" if it can): checked before blocks are taken."""
    if not rid:
        return "request_id is required"
    if not prompt:
        return "prompt_token_ids is required (the node verifies its cache hits token by token)"
    if request.num_tokens and request.num_tokens != len(prompt):
        return f"num_tokens is {request.num_tokens} but prompt_token_ids has {len(prompt)}"
    if len(prompt) >= eng.max_model_len:
        return f"prompt has {len(prompt)} tokens but the model's context is {eng.max_model_len} tokens"
    need = math.ceil(len(prompt) / eng.block_size)
    if need > eng.num_blocks:
        return f"prompt needs {need} KV blocks but the KV cache has only {eng.num_blocks} blocks"
    vocab = eng.model_config.vocab_size
    if any(t >= vocab for t in prompt):
        return f"prompt token ids must be in [0, {vocab})"
    return ""


class _DecodeService(kv_pb2_grpc.DecodeNodeServicer):
    def __init__(self, node: DecodeServer) -> None:
        self.node = node

    @traced_rpc("decode_node.Decode", lambda r: {
        tracing.REQUEST_ID: r.request_id, tracing.GEN_AI_USAGE_INPUT_TOKENS: len(r.prompt_token_ids),
        tracing.RECOMPUTE: not r.first_token_ids})
    def Decode(self, request: kv_pb2.DecodeRequest, context: grpc.ServicerContext):
        rid = request.request_id
        if not rid:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        # This node's part of the request: from Decode's arrival (the prefill node's first token,
        # if any, is this node's first output) to the last sample's finish.
        rec = RequestRecorder(self.node.metrics.requests)
        params = sampling_from_proto(request.sampling)
        prompt = tuple(request.prompt_token_ids)
        try:
            if request.first_token_ids:  # its KV is reserved here: an accepted request
                stream = self._add_prefilled(request, prompt, params, context)
            else:
                # A recompute of a request reserved here was accepted; anything else is new.
                self.node.admit(context, accepted=self.node.reservations.get(rid) is not None)
                self._drop_for_recompute(rid, context)
                stream = self.node.aengine.add_request(prompt, params, request_id=rid,
                                                       resumed_output_tokens=request.resumed_output_tokens,
                                                       cache_salt=request.cache_salt)
        except InvalidRequestError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except EngineStoppedError as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        self.node.num_decodes += 1
        context.add_callback(stream.cancel)  # client went away -> abort, blocks freed
        beats = (lambda: self.node.aengine.progress) if request.heartbeat_s > 0 else None
        yield from _stream(stream, ResponseBuilder(rid, params.n), context, rec,
                           heartbeats=beats, heartbeat_s=max(request.heartbeat_s, MIN_HEARTBEAT_S))

    def _add_prefilled(self, request, prompt: tuple[int, ...], params, context) -> OutputStream:
        rid = request.request_id
        if params.n != 1:  # the samples would fork at the prompt's last step, which ran elsewhere
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a prefilled request continues one sequence: n must be 1, got {params.n}")
        try:
            self.node.inbox.take(rid, prompt)
        except KeyError as err:
            context.abort(grpc.StatusCode.NOT_FOUND, err.args[0])
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except NotReadyError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        try:
            return self.node.aengine.add_prefilled_request(
                rid, prompt, list(request.first_token_ids), params, num_cached_tokens=request.cached_prompt_tokens,
                resumed_output_tokens=request.resumed_output_tokens, cache_salt=request.cache_salt)
        except InvalidRequestError:
            self.node.aengine.release_kv(rid)  # taken off the table above: nobody else will
            raise

    def _drop_for_recompute(self, rid: str, context) -> None:
        found, released = self.node.drop_reservation(rid)
        if found and not released:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"request {rid!r}: a KV push into its reservation is still in flight")

    def AbortDecode(self, request: serving_pb2.AbortRequest, context):
        rid = request.request_id
        running = self.node.aengine.abort(rid)
        reserved, _ = self.node.drop_reservation(rid)
        return serving_pb2.AbortResponse(found=running or reserved)


def _with_heartbeats(stream: OutputStream, progress: Callable[[], int] | None, every_s: float):
    """The stream's outputs; while it stays silent for ``every_s``, the engine's progress
    counter instead (an int: a heartbeat to send), but only when it moved since the last one:
    a wedged engine sends nothing and the router's progress deadline gives up on this node.
    ``progress`` None: no heartbeats (an older router did not ask for them)."""
    if progress is None:
        yield from stream
        return
    seen = progress()
    while True:
        try:
            out = stream.get(every_s)
        except TimeoutError:
            now = progress()
            if now != seen:
                seen = now
                yield now
            continue
        if out is None:
            return
        yield out


def _stream(stream: OutputStream, builder: ResponseBuilder, context: grpc.ServicerContext,
            rec: RequestRecorder | None = None, heartbeats: Callable[[], int] | None = None,
            heartbeat_s: float = 0.5):
    dtrace = DecodeStreamTrace()  # built here, where the Decode span is current
    try:
        for out in _with_heartbeats(stream, heartbeats, heartbeat_s):
            if isinstance(out, int):
                yield builder.heartbeat(out)
                continue
            dtrace.output(out)
            if rec is not None:
                _record(rec, out)
            yield from builder.responses(out)
    except (RequestFailedError, EngineStoppedError) as err:
        # A failed step (INTERNAL, "engine step failed: ...") ends in the stream even before any
        # output: the router moves the request once on it. A stopped engine (shut down, or
        # unhealthy) is the node gone: UNAVAILABLE, as the call's status if nothing was sent.
        code = grpc.StatusCode.UNAVAILABLE if isinstance(err, EngineStoppedError) else grpc.StatusCode.INTERNAL
        if builder.num_messages == 0 and code is grpc.StatusCode.UNAVAILABLE:
            context.abort(code, str(err))
        dtrace.failed(str(err), code.name)
        yield from builder.error(code.value[0], str(err))
    finally:
        dtrace.end()


def _record(rec: RequestRecorder, out) -> None:
    """One engine output into the node's request metrics (decode_node: docs/observability.md)."""
    now = rec.clock()
    rec.scheduled(out.metrics.first_scheduled_time)
    for c in out.outputs:
        rec.sample(c.index, len(c.new_token_ids), c.finish_reason, now)
    if out.finished:
        rec.finish(len(out.prompt_token_ids), now)
