"""The prefill node's server: PrefillNode.Prefill on the shared node base (node/server.py).

Prefill = the request run with max_tokens=1 and its KV held after it finishes, then the blocks
the decode node does not already hold pushed into its reservation, then the blocks released::

    prompt blocks here:  [ p0 p1 | p2 p3 p4 ]     reservation.num_cached_blocks = 2
                           held    pushed -> reservation.block_ids

With layer-wise streaming (``NodeConfig.kv_streaming``, on by default) the pushes start before
the prefill ends: the engine reports after each layer of each step which blocks are final, and
the request's ``KVStreamer`` (prefill_node/kv_streamer.py) sends them from its own thread in
rectangles of layers x blocks while later layers and chunks compute; once the first token is
sampled only the rest goes out. Off, the whole reservation goes in one push after the prefill.
Either way Prefill returns when every block of every layer landed (or fails with the
transfer's code, and the router recomputes on the decode node).

The first token is sampled here with the request's own sampling parameters (seed,
temperature, penalties...), so it follows the same distribution as on a single engine; the
decode node continues from it. Stop strings are left to the decode node, which detokenizes.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time

import grpc
from opentelemetry.trace import SpanKind

from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from kv_index.nodes import Role, StepReport
from kv_transfer.layout import PoolLayout
from kv_transfer.transport import KVSender, PushResult, TransferError
from node.config import NodeConfig
from node.engine_thread import EngineStoppedError, OutputStream, RequestFailedError
from node.kv_inbox import InboxReceiver, KVInbox
from node.prefix_fetch import PrefixFetcher
from node.rpc_trace import child_span, prefill_phases, traced_rpc
from node.server import Handover, NodeServer
from node.tp_engine import build_engine, send_view, tp_landing
from prefill_node.inflight import InflightPrefills
from prefill_node.kv_streamer import KVStreamer
from protos.convert import sampling_from_proto, token_logprobs_to_proto
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from telemetry import tracing
from telemetry.log_limit import RateLimitedLog
from telemetry.metrics import PREFILLED
from telemetry.request_recorder import RequestRecorder
from tokens.block_hash import hash_prompt_blocks
from tokens.sampling_params import SamplingParams

log = logging.getLogger(__name__)
# Failed transfers, per status: the first logged, then a count at most every 10 s.
transfer_log = RateLimitedLog(log)

# A push that takes longer is treated as a failed transfer (the router then recomputes).
PUSH_TIMEOUT_S = 60.0
# Layer-wise streaming: the least a push carries while the prefill still computes (smaller
# pieces wait for more): a few times the fixed cost per transfer at loopback bandwidth.
KV_STREAM_MIN_PUSH_BYTES = 1 << 20


class PrefillServer(NodeServer):
    role = Role.PREFILL
    # KVTransfer: only PushBlocks, the prefixes this node fetches (node/prefix_fetch.py).
    services = tuple(kv_pb2.DESCRIPTOR.services_by_name[n].full_name for n in ("PrefillNode", "KVTransfer"))
    long_methods = ("/pdserve.v1.PrefillNode/Prefill", "/pdserve.v1.KVTransfer/PushBlocks")

    def __init__(self, config: NodeConfig, engine: LLMEngine | None = None,
                 kv_sender: KVSender | None = None) -> None:
        # Prefill nodes never detokenize (the decode node streams the text), but a structured
        # output's first token is sampled here under its grammar, which is built from the
        # tokenizer's vocabulary. The KV sender (to decode nodes, and to peers fetching a prefix
        # from here) is the node base's.
        super().__init__(config, engine or build_engine(config, load_tokenizer=config.load_tokenizer), kv_sender)
        # Where the prefixes it fetches land (node/kv_inbox.py), and the fetches themselves.
        self.inbox = KVInbox(config, self.engine.kv_cache, self.engine.fingerprint, self.engine.model_config.num_layers,
                             release=lambda rid: self.aengine.release_kv(rid), landing=tp_landing(self.tp, self.engine))
        self.fetcher = PrefixFetcher(self)
        kv_pb2_grpc.add_KVTransferServicer_to_server(InboxReceiver(self.inbox), self.grpc_server)
        self._healthy_sender: KVSender | None = None  # kept while a KV fault is injected
        self._kv_fault_senders: list = []  # every damaging sender so far, for its counts
        # Layer-wise KV streaming (docs/cluster.md, "KV data plane"): on unless configured off;
        # an attribute so a benchmark can compare both ways on one node.
        # Only on CPU: there torch has written layer i's K/V when the layer returns. On CUDA the
        # write is only enqueued then, and reading the blocks from the sender thread needs an
        # event per layer, which is not built; a GPU prefill node pushes after the prefill.
        # Tensor parallel: off too (a layer's KV is in every rank's pool; the push after the
        # prefill gathers it: node/tp_engine.py).
        self.kv_streaming = config.kv_streaming and self.engine.device.type == "cpu" and self.tp is None
        if config.kv_streaming and not self.kv_streaming and self.tp is None:
            log.info("layer-wise KV streaming is CPU-only for now; %s pushes KV after the prefill",
                     self.engine.device)
        # A streamed push waits until it carries at least this much, unless the prefill is done
        # (fixed cost per push: docs/benchmarks.md, transfer).
        self.kv_stream_min_push_bytes = KV_STREAM_MIN_PUSH_BYTES
        self.inflight = InflightPrefills()  # their count, and the streamers of streamed ones
        if self.tp is None:  # a TP engine refuses layer reports (rank 0 holds only its heads)
            self.engine.set_kv_layer_listener(self._on_kv_layer)
        kv_pb2_grpc.add_PrefillNodeServicer_to_server(_PrefillService(self), self.grpc_server)
        self.num_prefills = 0
        self.num_transfer_failures = 0

    def _on_kv_layer(self, request_id: str, layer: int, ready_blocks: int, table: tuple[int, ...]) -> None:
        # The engine thread, after each layer of a step: hand the news over, nothing more.
        streamer = self.inflight.streamer_for(request_id)
        if streamer is not None:
            streamer.on_layer(layer, ready_blocks, table)

    def kv_endpoints(self) -> tuple[str, ...]:
        """The transports this node sends KV over besides gRPC, without addresses
        (``shm://<host key>/``, ``tcp://``; none with TLS): from them and the decode node's
        endpoints the router predicts a pair's transport before its first transfer."""
        advertised = getattr(self.kv_sender, "advertised", None)
        return tuple(advertised()) if advertised is not None else ()

    def start(self, handover: Handover | None = None) -> str:
        self.inbox.start()
        return super().start(handover)

    def stop(self, deregister: bool = True, grace_s: float = 1.0) -> None:
        self.set_kv_fault(None)  # the node base closes the healthy sender
        super().stop(deregister=deregister, grace_s=grace_s)
        self.inbox.stop()
        self.fetcher.close()

    def set_kv_fault(self, mode: str | None) -> None:
        """Fault injection (prefill_node/faults.py): damage every KV push from now on ("flip",
        "cut"), or send normally again (None). Called in this process only (the node actor's
        ``set_kv_fault``, tests); nothing on the wire reaches it."""
        from prefill_node.faults import CorruptingFallbackSender

        if self._healthy_sender is not None:
            self.kv_sender.close()
            self.kv_sender, self._healthy_sender = self._healthy_sender, None
        if mode is not None:  # every transport this node sends over is damaged
            self._healthy_sender, self.kv_sender = self.kv_sender, CorruptingFallbackSender(mode, self.config.tls)
            self._kv_fault_senders.append(self.kv_sender)

    def role_stats(self) -> dict:
        damaged: dict[str, int] = {}  # KV pushes a fault damaged, per transport (chaos reads it)
        for sender in self._kv_fault_senders:
            for name, n in sender.pushes_by_transport.items():
                damaged[name] = damaged.get(name, 0) + n
        return {"prefills": self.num_prefills, "transfer_failures": self.num_transfer_failures,
                "prefills_in_progress": self.inflight.count, "kv_fault_pushes": damaged}


def first_token_params(params: SamplingParams, resumed: int = 0) -> SamplingParams:
    """The request's parameters for sampling its first token here only: same distribution
    (min_tokens still bans EOS), one token, no stop strings (no text here). ``resumed``: output
    tokens already produced (a migrated request), so the one sampled here is number
    ``resumed`` and max_tokens / min_tokens count them too."""
    return dataclasses.replace(params, max_tokens=resumed + 1, min_tokens=min(params.min_tokens, resumed + 1),
                               stop=(), include_stop_str_in_output=False)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillOutcome:
    """What one prefill reports (``PrefillResponse``, the push span): its final output with the
    first token, its compute time, and how its KV reached the decode node. The KV figures stay
    zero (transport "") when nothing was sent: the decode node already caches every block."""

    final: RequestOutput
    prefill_s: float
    streamed: bool  # layer-wise, while it computed (prefill_node/kv_streamer.py)
    blocks_sent: int = 0
    bytes_sent: int = 0
    transport: str = ""
    transfer_s: float = 0.0  # the pushes' own time: the attempts that landed
    exposed_s: float = 0.0  # what the request waited for its KV beyond the compute
    pushes: int = 0
    fallbacks: int = 0

    def pushed(self, result: PushResult, waited_s: float) -> PrefillOutcome:
        """Sent in one push after the prefill, which waited ``waited_s`` for every attempt; the
        transport is priced by the one that landed (kv_fallbacks says a detour came before it)."""
        return dataclasses.replace(
            self, blocks_sent=result.blocks_written, bytes_sent=result.bytes_written, transport=result.transport,
            transfer_s=result.seconds or waited_s, exposed_s=waited_s, pushes=1, fallbacks=result.fallbacks)

    def streamed_by(self, streamer: KVStreamer, num_blocks: int, sent_from: float) -> PrefillOutcome:
        """Sent by ``streamer``: exposed is from the first token sampled (the compute's end;
        ``sent_from`` when unknown) to the last push landed."""
        done_compute = self.final.metrics.first_token_time or sent_from
        return dataclasses.replace(
            self, blocks_sent=num_blocks, bytes_sent=streamer.bytes_sent, transport=streamer.transport,
            transfer_s=streamer.transfer_s, exposed_s=max(0.0, (streamer.last_landed or done_compute) - done_compute),
            pushes=streamer.pushes, fallbacks=streamer.fallbacks)

    def span_attributes(self) -> dict:
        # The receiver takes nothing unless every checksum matched: a push that returns was verified.
        return {tracing.KV_BLOCKS: self.blocks_sent, tracing.KV_BYTES: self.bytes_sent,
                tracing.KV_TRANSFER_S: self.transfer_s, tracing.KV_CHECKSUM_VERIFIED: True,
                "pdserve.kv.transport": self.transport, "pdserve.kv.pushes": self.pushes,
                "pdserve.kv.fallbacks": self.fallbacks, "pdserve.kv.transfer_exposed_s": self.exposed_s}

    def response(self, resumed_output_tokens: int) -> kv_pb2.PrefillResponse:
        c = self.final.outputs[0]
        first = c.token_ids[resumed_output_tokens:]  # a resumed request's earlier outputs are known
        first_logprobs = token_logprobs_to_proto(first[:1], c.logprobs and c.logprobs[:1],
                                                 c.new_top_logprobs and c.new_top_logprobs[:1])
        return kv_pb2.PrefillResponse(
            first_token_ids=first, first_logprobs=first_logprobs, cached_tokens=self.final.num_cached_tokens,
            blocks_sent=self.blocks_sent, bytes_sent=self.bytes_sent,
            prefill_s=self.prefill_s, transfer_s=self.transfer_s, transport=self.transport,
            transfer_exposed_s=self.exposed_s, kv_streamed=self.streamed, kv_pushes=self.pushes,
            kv_fallbacks=self.fallbacks,
        )


class _PrefillService(kv_pb2_grpc.PrefillNodeServicer):
    def __init__(self, node: PrefillServer) -> None:
        self.node = node

    @traced_rpc("prefill_node.Prefill", lambda r: {
        tracing.REQUEST_ID: r.request_id, tracing.GEN_AI_USAGE_INPUT_TOKENS: len(r.prompt_token_ids),
        "pdserve.decode_address": r.decode_address})
    def Prefill(self, request: kv_pb2.PrefillRequest, context: grpc.ServicerContext):
        node = self.node
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        params = sampling_from_proto(request.sampling)
        problem = _prefill_problem(rid, prompt, params, request, node.engine)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        node.admit(context)
        t0 = time.monotonic()
        # This node's part of the request: arrival -> first token (ttft) -> KV pushed (e2e).
        rec = RequestRecorder(node.metrics.requests, arrival=t0)
        res = request.reservation
        # The prefix another node holds, first (node/prefix_fetch.py): a failed fetch is computed.
        fetched = node.fetcher.fetch(rid, prompt, request.fetch, request.cache_salt) if request.HasField("fetch") else None
        try:
            # Layer-wise streaming: the KV leaves while the prefill computes (prefill_node/kv_streamer.py).
            streamer = self._streamer(rid, prompt, request, context) if res.block_ids and node.kv_streaming else None
            stream = self._start(rid, prompt, params, request, streamer, context)
            context.add_callback(stream.cancel)  # the router gave up: stop computing
            try:
                outcome = self._compute(stream, rid, prompt, request, streamer, context, t0, rec)
                if res.block_ids:
                    outcome = self._send_kv(outcome, rid, prompt, request, streamer, context)
            finally:
                if streamer is not None:  # before the blocks go: it may still read them
                    self._stop_streamer(rid, streamer)
                # Always: the blocks stay in this node's prefix cache either way, unpinned.
                _release(node.aengine.release_kv, rid)
        finally:
            if fetched is not None:
                _release(node.fetcher.done, rid)
        node.num_prefills += 1
        # The request leaves this node here: "prefilled", whatever the decode node makes of it.
        rec.sample(0, 0, PREFILLED)
        rec.finish(len(prompt))
        resp = outcome.response(request.resumed_output_tokens)
        if fetched is not None:
            fetched.fill(resp)
        return resp

    def _start(self, rid: str, prompt: list[int], params: SamplingParams, request: kv_pb2.PrefillRequest,
               streamer: KVStreamer | None, context) -> OutputStream:
        """Queue the prefill with its KV held (streamed layer by layer with a streamer)."""
        try:
            resumed = request.resumed_output_tokens
            stream = self.node.aengine.add_request(prompt, first_token_params(params, resumed), request_id=rid,
                                                   hold_kv=True, resumed_output_tokens=resumed,
                                                   stream_kv=streamer is not None, cache_salt=request.cache_salt)
        except (InvalidRequestError, EngineStoppedError) as err:
            if streamer is not None:
                self._stop_streamer(rid, streamer)
            code = (grpc.StatusCode.INVALID_ARGUMENT if isinstance(err, InvalidRequestError)
                    else grpc.StatusCode.UNAVAILABLE)
            context.abort(code, str(err))
        if streamer is not None:  # a push failure stops the compute too
            streamer.on_error = stream.cancel
            if streamer.error is not None:
                stream.cancel()
        return stream

    def _compute(self, stream: OutputStream, rid: str, prompt: list[int], request: kv_pb2.PrefillRequest,
                 streamer: KVStreamer | None, context, t0: float, rec: RequestRecorder) -> PrefillOutcome:
        """Wait for the first token; record the prefill (metrics, phases, and a step report
        when it ran alone: pure compute, no queueing behind another request)."""
        node = self.node
        with node.inflight.track() as run:
            final = self._wait(stream, context, rid, request, streamer)
        prefill_s = time.monotonic() - t0
        prefill_phases(t0, final)
        rec.scheduled(final.metrics.first_scheduled_time)
        rec.sample(0, len(final.outputs[0].token_ids), now=t0 + prefill_s)
        if run.alone and node.publisher is not None:
            node.publisher.submit_step(StepReport(
                new_tokens=len(prompt) - final.num_cached_tokens, context_tokens=len(prompt), seconds=prefill_s))
        return PrefillOutcome(final, prefill_s, streamed=streamer is not None)

    def _send_kv(self, outcome: PrefillOutcome, rid: str, prompt: list[int], request: kv_pb2.PrefillRequest,
              streamer: KVStreamer | None, context) -> PrefillOutcome:
        """The KV into the reservation: the rest of the stream, or one push now."""
        node, res = self.node, request.reservation
        t1 = time.monotonic()
        with child_span("kv_transfer.push", context, {
                "pdserve.decode_address": request.decode_address, tracing.KV_CACHED_BLOCKS: res.num_cached_blocks,
                "pdserve.kv.streamed": streamer is not None}, SpanKind.CLIENT) as span:
            if streamer is None:
                result = self._push(rid, prompt, request, context)
                outcome = outcome.pushed(result, waited_s=time.monotonic() - t1)
            else:
                self._finish_stream(rid, request, streamer, context)
                outcome = outcome.streamed_by(streamer, len(res.block_ids), sent_from=t1)
            span.set_attributes(outcome.span_attributes())
        node.metrics.transfer_bytes.inc(outcome.bytes_sent)
        node.metrics.transfer_seconds.observe(outcome.transfer_s)
        return outcome

    def _wait(self, stream, context, rid: str, request, streamer: KVStreamer | None) -> RequestOutput:
        try:
            final = stream.result()
        except RequestFailedError as err:
            context.abort(grpc.StatusCode.INTERNAL, str(err))
        except EngineStoppedError as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        if final.outputs[0].finish_reason == "abort" or not final.outputs[0].token_ids:
            if streamer is not None and streamer.error is not None:  # the stream failed: its code
                self._transfer_failed(rid, request, streamer.error, context)
            context.abort(grpc.StatusCode.CANCELLED, f"request {final.request_id!r} was aborted")
        return final

    # ---- layer-wise streaming
    def _streamer(self, rid: str, prompt: list[int], request: kv_pb2.PrefillRequest, context) -> KVStreamer | None:
        """A started streamer for this request, registered for the engine's layer reports; None
        when another request holds the id (add_request then refuses it)."""
        node, eng = self.node, self.node.engine
        res = request.reservation
        bs = eng.block_size
        num_blocks = math.ceil(len(prompt) / bs)
        cached = res.num_cached_blocks
        if num_blocks - cached != len(res.block_ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"reservation: {num_blocks - cached} blocks to send after skipping {cached}, "
                          f"but {len(res.block_ids)} dest_block_ids")
        hashes = hash_prompt_blocks(prompt, bs, eng.fingerprint.encode(), salt=request.cache_salt)  # full blocks
        dest = list(res.block_ids)

        def push(layers: range, a: int, b: int, table: tuple[int, ...]) -> PushResult:
            # Blocks [a, b) of the prompt: header first_block_index = a, KV of positions
            # [0, min(b * bs, prompt)) once written (kv_transfer/validate.py accepts a sub-range).
            return node.kv_sender.push(
                request.decode_address, eng.kv_cache, request_id=rid, fingerprint=eng.fingerprint,
                src_block_ids=table[:b], block_hashes=hashes[:b], num_tokens=min(b * bs, len(prompt)),
                dest_block_ids=dest[a - cached : b - cached], token=res.token, skip_leading_blocks=a,
                layers=layers, timeout=PUSH_TIMEOUT_S, endpoints=tuple(res.kv_endpoints))

        unit = PoolLayout.of(eng.kv_cache).block_bytes
        streamer = KVStreamer(push, num_layers=eng.model_config.num_layers, num_blocks=num_blocks, skip=cached,
                              min_push_units=math.ceil(node.kv_stream_min_push_bytes / unit),
                              name=f"kv-stream-{rid}"[:60], start=False)
        if not node.inflight.add_streamer(rid, streamer):
            return None
        streamer.start()
        return streamer

    def _finish_stream(self, rid: str, request, streamer: KVStreamer, context) -> None:
        """Send what is left now that the prefill finished; abort on a failed push."""
        streamer.finish(lambda: self.node.aengine.held_block_table(rid))
        if not streamer.wait(PUSH_TIMEOUT_S):
            streamer.cancel()
            self._transfer_failed(rid, request, TransferError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"KV stream not done {PUSH_TIMEOUT_S:.0f}s after the prefill"),
                context)
        if streamer.error is not None:
            self._transfer_failed(rid, request, streamer.error, context)

    def _stop_streamer(self, rid: str, streamer: KVStreamer) -> None:
        streamer.cancel()
        streamer.wait()  # bounded by the push in flight's own timeout
        self.node.inflight.remove_streamer(rid, streamer)

    def _transfer_failed(self, rid: str, request, err: TransferError, context) -> None:
        node = self.node
        node.num_transfer_failures += 1
        node.metrics.transfer_failures.inc()
        # Once per failed request: a decode node that is gone or refusing fails every push to it.
        transfer_log.warning(f"KV transfer {err.code.name}", "KV transfer of %r to %s failed: %s", rid,
                             request.decode_address, err)
        # The receiver's code (INVALID_ARGUMENT, DATA_LOSS, NOT_FOUND) or UNAVAILABLE /
        # DEADLINE_EXCEEDED when it could not be reached: the router recomputes on decode.
        context.abort(err.code, f"KV transfer to {request.decode_address} failed: {err.details}")

    def _push(self, rid: str, prompt: list[int], request: kv_pb2.PrefillRequest, context) -> PushResult:
        node, eng = self.node, self.node.engine
        res = request.reservation
        bs = eng.block_size
        # The table may run past the prompt (the sampled token's slot): only prompt blocks go.
        src = node.aengine.held_block_table(rid)[: math.ceil(len(prompt) / bs)]
        try:
            # Tensor parallel: from the blocks gathered with all their heads (node/tp_engine.py).
            pool, src = send_view(eng, node.tp, src, min(res.num_cached_blocks, len(src)))
            return node.kv_sender.push(
                request.decode_address, pool,
                request_id=rid, fingerprint=eng.fingerprint, src_block_ids=src,
                block_hashes=hash_prompt_blocks(prompt, bs, eng.fingerprint.encode(), salt=request.cache_salt),
                num_tokens=len(prompt), dest_block_ids=list(res.block_ids), token=res.token,
                skip_leading_blocks=res.num_cached_blocks, timeout=PUSH_TIMEOUT_S,
                endpoints=tuple(res.kv_endpoints),
            )
        except ValueError as err:  # the reservation does not fit this prompt
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"reservation: {err}")
        except TransferError as err:
            self._transfer_failed(rid, request, err, context)


def _release(release, rid: str) -> None:
    try:
        release(rid)
    except EngineStoppedError:
        pass  # the engine and its blocks are gone with it


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
