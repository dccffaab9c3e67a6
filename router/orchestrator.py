"""Request orchestration: validate -> tokenize -> hash -> one index lookup -> place -> drive
the nodes -> relay the token stream.

Disaggregated path (kv.proto has the wire-level walk-through)::

    ReserveBlocks(decode) -> Prefill(prefill, carries the reservation) -> Decode(decode, first tokens)
          |                       | fails: ReleaseReservation, then Decode without first tokens
          | fails: Decode without first tokens (the decode node prefills; "local")
    first token already ends the request -> ReleaseReservation, complete here

Errors before any output are ``RouterError`` (the server turns them into gRPC statuses);
after output started they are in-stream ``Error`` messages. The node view comes from
router/node_view.py (a background thread) so a request never waits for the registry; the only
Redis round trip on the request path is the prefix match.

Admission: the global ``max_inflight`` bound, then the policy's estimate against the request's
SLO class (``router.admission.decide``); both reject with RESOURCE_EXHAUSTED and a retry hint.
Index accuracy: every disaggregated request compares the cached tokens placement predicted
with those the prefill node reports it reused (``IndexAccuracy``).

Node failures (router/migration.py): a prefill node that fails leaves the prompt to the decode
node (under a fresh node request id, so a half-written reservation cannot collide); a decode
stream that breaks, before or after output, moves the request: prompt + the tokens already
streamed are placed again, away from the failed node, and the stream goes on where it stopped
(at most ``max_migrations`` times)::

    _attempts: _execute(prep) --stream breaks--> _migrate -> _execute(prep') -> ...
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace

import grpc
from opentelemetry.context import Context

from kv_index.nodes import NodeInfo, Role, index_freshness
from kv_index.reader import IndexReader
from protos.conventions import grpc_options, retry_after_ms
from protos.convert import finish_reason_to_proto, sampling_from_proto, sampling_to_proto, slo_class_from_proto
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from protos.pdserve.v1 import serving_pb2 as pb
from router.admission import SLO_CLASSES, decide
from router.config import RouterConfig
from router.cost_model import CostBook
from router.migration import Continuation, Exclusions, continuation, is_node_failure
from router.node_view import IndexAccuracy, NodeRefresher, PrefillLedger
from router.placement import NoCapacityError, Placement, PlacementPolicy, PlacementRequest
from router.request_metrics import StreamObserver
from router.request_trace import RequestTrace
from router.tokenizer import ChatTemplateError, PromptTokenizer
from security.tls import aio_channel
from telemetry import tracing
from telemetry.log_limit import RateLimitedLog
from telemetry.metrics import RouterMetrics
from tokens.block_hash import hash_prompt_blocks
from tokens.detokenizer import IncrementalDetokenizer
from tokens.sampling_params import SamplingParams
from tokens.stop import FinishReason, stop_reason

log = logging.getLogger(__name__)
# Per-request node-call failures (a refused reservation, a full prefill queue) come at the
# request rate under overload: logged once per reason, then a count every 10 s (telemetry/log_limit.py).
node_call_log = RateLimitedLog(log)


class RouterError(Exception):
    """A failure before any output: becomes the RPC's status (with retry-after-ms if set)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None,
                 reason: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.param = param  # the request field at fault, when one is (HTTP's error "param")
        # One word for the requests_rejected_total metric.
        self.reason = reason or _REJECT_REASONS.get(code, code.name.lower())


_REJECT_REASONS = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.ALREADY_EXISTS: "duplicate_id",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
}


# ----------------------------------------------------------------------------- per request
@dataclass(slots=True)
class Prepared:
    """A validated request, placed."""

    client_id: str
    node_id: str  # the id the nodes see: unique per attempt, so clients cannot collide on nodes
    prompt: list[int]
    params: SamplingParams
    sampling: pb.SamplingParams  # normalized: every field explicit
    block_hashes: list[int]
    fingerprint: str
    block_size: int
    placement: Placement
    slo_class: str = "relaxed"
    # A migrated attempt: the last ``resumed`` tokens of ``prompt`` are output already streamed.
    resumed: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        """The client's prompt, without the tokens a migration appended."""
        return len(self.prompt) - self.resumed


@dataclass(slots=True)
class Running:
    """What Abort needs to stop a request wherever it is, and what a migration continues from."""

    node_request_id: str | None = None
    decode_address: str | None = None
    prefill_call: object | None = None
    aborted: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    trace: RequestTrace = field(default_factory=RequestTrace.off)  # the request's spans
    output_ids: list[int] = field(default_factory=list)  # tokens relayed to the client (n = 1)
    first_token_s: dict[int, float] = field(default_factory=dict)  # per sample, from arrival
    migrations: int = 0


class _NodeFailed(Exception):
    """A node's call or stream ended by the node failing (migration.NODE_FAILURE_CODES). The
    client sees UNAVAILABLE (retryable) if the request cannot move, whatever the node's code."""

    def __init__(self, node: NodeInfo, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__(message)
        self.node = node
        self.code = code
        self.message = message


class Orchestrator:
    """Serves Generate/Abort. Lives on one asyncio loop; ``_prepare`` runs on a worker thread
    (tokenizing and the Redis lookup block)."""

    def __init__(self, config: RouterConfig, tokenizer: PromptTokenizer, refresher: NodeRefresher,
                 reader: IndexReader, policy: PlacementPolicy, costs: CostBook | None = None,
                 metrics: RouterMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else RouterMetrics(config.model_name)
        self.costs = costs
        self.accuracy = IndexAccuracy()
        self.ledger = PrefillLedger()
        self.tokenizer = tokenizer
        self.refresher = refresher
        self.reader = reader
        self.policy = policy
        self.vocab_size = config.vocab_size or tokenizer.vocab_size
        self.eos_token_ids = frozenset(config.eos_token_ids if config.eos_token_ids is not None
                                       else tokenizer.eos_token_ids)
        self._running: dict[str, Running] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.exclusions = Exclusions(config.exclude_failed_node_s)
        self._background: set[asyncio.Task] = set()  # best-effort aborts on failed nodes
        self.inflight = 0
        # Set by RouterServer.drain: new requests get UNAVAILABLE (another replica takes them),
        # those in flight finish.
        self.draining = False

    # -- admission and validation ------------------------------------------------------------
    def _prepare(self, req: pb.GenerateRequest, client_id: str, max_tokens_to_context: bool = False,
                  excluded: frozenset = frozenset()) -> Prepared:
        """``excluded``: (node id, address) of nodes that failed lately (Exclusions.active)."""
        cfg = self.config
        slo_class = slo_class_from_proto(req.slo_class) or cfg.default_slo_class
        if req.model and req.model != cfg.model_name:
            raise RouterError(grpc.StatusCode.NOT_FOUND,
                              f"model {req.model!r} is not served here; served models: [{cfg.model_name!r}]")
        prompt = self._prompt_ids(req)
        tracing.event("tokenized", {tracing.GEN_AI_USAGE_INPUT_TOKENS: len(prompt)})
        try:
            params = sampling_from_proto(req.sampling)
            if max_tokens_to_context:  # capped below, once the prompt's length is known
                params = replace(params, max_tokens=cfg.max_model_len)
            params.validate(self.vocab_size)
        except ValueError as e:  # SamplingParamError names the field
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(e), param=getattr(e, "field", None)) from None
        n = len(prompt)
        if n == 0:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty (0 tokens)",
                              param=req.WhichOneof("prompt"))
        if n > cfg.effective_max_prompt_tokens:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"this model's maximum context length is {cfg.max_model_len} tokens and a prompt "
                              f"may use {cfg.effective_max_prompt_tokens} of them (max_prompt_tokens); "
                              f"the prompt has {n} tokens")
        if max_tokens_to_context:
            # OpenAI's chat default: no max_tokens = as many as the context leaves.
            budget = max(params.min_tokens, cfg.max_model_len - n)
            if cfg.max_tokens_limit is not None:
                budget = min(budget, cfg.max_tokens_limit)
            params = replace(params, max_tokens=budget)
        if cfg.max_tokens_limit is not None and params.max_tokens > cfg.max_tokens_limit:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"max_tokens is {params.max_tokens}; max_tokens_limit is {cfg.max_tokens_limit}")
        if n + params.max_tokens > cfg.max_model_len:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                              f"{n + params.max_tokens} exceeds this model's maximum context length of "
                              f"{cfg.max_model_len} tokens (max_model_len)")
        view = self.refresher.view
        if not view.has_decode:
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              view.error or f"no live decode node for model {cfg.model_name!r}; retry later")
        try:
            try:
                hashes, placement = self._place(view, prompt, params.n, params.max_tokens, slo_class, excluded)
            except NoCapacityError:
                if not excluded:
                    raise
                # Avoiding failed nodes is a preference for a new request: better a node that
                # failed a moment ago (it may be back) than no answer.
                hashes, placement = self._place(view, prompt, params.n, params.max_tokens, slo_class, frozenset())
        except NoCapacityError as e:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        if placement.estimate is not None:
            verdict = decide(placement.estimate, SLO_CLASSES[slo_class], n)
            if not verdict.admit:
                raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, verdict.reason, verdict.retry_after_ms, "slo")
        return Prepared(client_id, _attempt_id(client_id), prompt, params, sampling_to_proto(params), hashes,
                        view.fingerprint, view.block_size, placement, slo_class)

    def _place(self, view, prompt: list[int], n: int, max_tokens: int, slo_class: str,
               excluded: frozenset) -> tuple[list[int], Placement]:
        """Block hashes, one index lookup, the policy's choice among the nodes not excluded.
        Raises NoCapacityError."""
        nodes = Exclusions.usable(view.nodes, excluded)
        hashes = hash_prompt_blocks(prompt, view.block_size, view.fingerprint.encode())
        try:
            matched = self.reader.match(hashes, [x.node_id for x in nodes]) if self.policy.uses_index else {}
        except Exception as e:  # the index is a hint: route without it rather than fail
            log.warning("index lookup failed, placing without prefix information: %s", e)
            matched = {}
        tracing.event("index_matched", {"pdserve.index.longest_match_blocks": max(matched.values(), default=0)})
        placement = self.policy.choose(PlacementRequest(len(prompt), view.block_size, n, max_tokens, slo_class),
                                       nodes, matched, self.ledger.backlog_s())
        tracing.event("placed")
        return hashes, placement

    def _prompt_ids(self, req: pb.GenerateRequest) -> list[int]:
        kind = req.WhichOneof("prompt")
        if kind == "text":
            self._check_text_length(len(req.text), "text")
            return self.tokenizer.encode(req.text)
        if kind == "chat":
            if not req.chat.messages:
                raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, "chat prompt has no messages",
                                  param="chat.messages")
            limit = self.config.effective_max_prompt_tokens
            if len(req.chat.messages) > limit:  # chat templates write at least a role marker per message
                raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"chat prompt has {len(req.chat.messages)} messages; a prompt may use {limit} "
                                  f"tokens (max_prompt_tokens)", param="chat.messages")
            self._check_text_length(sum(len(m.content) + len(m.role) for m in req.chat.messages), "chat.messages")
            try:
                return self.tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in req.chat.messages])
            except ChatTemplateError as e:
                raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if kind == "tokens":
            ids = list(req.tokens.ids)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"token ids must be in [0, {self.vocab_size}) (the vocab size); got {bad[:5]}",
                                  param="tokens.ids")
            return ids
        raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, "no prompt: set one of text, chat or tokens",
                          param="prompt")

    def _check_text_length(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing it, text that cannot fit: every token covers at most
        ``max_token_chars`` characters, so longer text is surely over max_prompt_tokens (and
        tokenizing tens of MB would hold a router thread for seconds)."""
        cfg = self.config
        limit = cfg.effective_max_prompt_tokens * self.tokenizer.max_token_chars
        if chars > limit:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the prompt has {chars} characters: more than the {cfg.effective_max_prompt_tokens} "
                              f"tokens a prompt may use (max_prompt_tokens) can hold, at most "
                              f"{self.tokenizer.max_token_chars} characters per token", param=param)

    # -- the request ---------------------------------------------------------------------------
    async def generate(self, req: pb.GenerateRequest, *, trace_context: Context | None = None,
                       **options) -> AsyncIterator[pb.GenerateResponse]:
        """Yield the client's responses. Raises RouterError before the first one. ``options``:
        those of ``_generate``. Every front-end comes through here, so every request gets its
        root span (router/request_trace.py), rejections included; ``trace_context``: the
        caller's trace (from gRPC metadata or HTTP headers), None to start one."""
        rt = RequestTrace(self.config.model_name, req, trace_context)
        # aclosing: a consumer that stops reading closes the inner generator now (its finally
        # frees the in-flight slot), not whenever the garbage collector finds it.
        async with aclosing(self._generate(req, rt, **options)) as responses:
            try:
                async for resp in responses:
                    rt.feed(resp)
                    yield resp
            except BaseException as e:
                rt.failed(e)
                raise
            finally:
                rt.end()

    async def _generate(self, req: pb.GenerateRequest, rt: RequestTrace, *,
                        max_tokens_to_context: bool = False) -> AsyncIterator[pb.GenerateResponse]:
        """Yield the client's responses. Raises RouterError before the first one.
        ``max_tokens_to_context``: ignore the request's max_tokens and let it use the rest of the
        context (the HTTP API's chat default)."""
        arrival = time.monotonic()
        metrics = self.metrics
        if self.draining:
            metrics.rejected("unavailable")
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "this router is shutting down (draining); retry",
                              self.config.retry_after_ms)
        if self.inflight >= self.config.max_inflight:
            metrics.rejected("overloaded")
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{self.inflight} requests in flight (max_inflight {self.config.max_inflight}); "
                              f"retry after {self.config.retry_after_ms} ms", self.config.retry_after_ms)
        client_id = req.request_id if req.HasField("request_id") and req.request_id else uuid.uuid4().hex
        if client_id in self._running:
            metrics.rejected("duplicate_id")
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"request id {client_id!r} is already running")
        self.inflight += 1
        metrics.running.inc()
        run = self._running[client_id] = Running(trace=rt)
        observer = StreamObserver(metrics.requests, arrival)
        sent = False
        try:
            # to_thread runs it in a copy of this task's context: router.place is current there
            prep = await asyncio.to_thread(rt.place, self._prepare, req, client_id, max_tokens_to_context,
                                           self.exclusions.active(time.monotonic()))
            metrics.decision(prep.placement.kind)
            async for resp in self._attempts(prep, run, arrival):
                if not sent:
                    sent = True
                    observer.queued(run.timings.get("queue_s", 0.0))
                resp.request_id = client_id
                observer.feed(resp)
                yield resp
        except RouterError as e:
            if not sent:
                metrics.rejected(e.reason)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away (its task was cancelled, or it closed this stream): stop the
            # work on the nodes too, shielded from our own cancellation.
            await asyncio.shield(self._abort_on_nodes(run))
            raise
        finally:
            if sent:
                observer.finish()
            self.inflight -= 1
            metrics.running.dec()
            self._running.pop(client_id, None)

    async def _attempts(self, prep: Prepared, run: Running, arrival: float) -> AsyncIterator[pb.GenerateResponse]:
        """``_execute``, and again elsewhere each time a node fails (router/migration.py)."""
        yielded = False
        while True:
            try:
                async for resp in self._execute(prep, run, arrival):
                    yielded = True
                    yield resp
                return
            except _NodeFailed as e:
                failure = e  # the except clause unbinds its own name
                outcome = await self._migrate(prep, run, failure, yielded)
            except RouterError as e:  # a later attempt refused before its output: the client has some
                if not yielded:
                    raise
                failure = _NodeFailed(prep.placement.decode_node, e.message, e.code)
                outcome = None
            if isinstance(outcome, Prepared):
                prep = outcome
                continue
            if run.aborted:
                for resp in _aborted(prep):
                    yield resp
                return
            if isinstance(outcome, FinishReason):  # the node died between the last token and its Complete
                yield self._complete_migrated(prep, run, outcome, arrival)
                return
            self.metrics.migrated("gave_up")
            if not yielded:
                raise RouterError(failure.code, failure.message)
            yield pb.GenerateResponse(error=pb.Error(code=failure.code.value[0], message=failure.message))
            for i in range(prep.params.n):
                yield pb.GenerateResponse(complete=pb.Complete(index=i, finish_reason=finish_reason_to_proto(
                    FinishReason.ERROR)))
            return

    async def _migrate(self, prep: Prepared, run: Running, failure: _NodeFailed,
                       yielded: bool) -> Prepared | FinishReason | None:
        """The next attempt after ``failure``: placed away from the failed node, continuing
        after the tokens already streamed. A FinishReason when those tokens already end the
        request; None when it cannot move (n > 1 after output, no migration left, no live
        node in time)."""
        cfg = self.config
        now = time.monotonic()
        self.exclusions.exclude(failure.node, now)
        self._abort_in_background(failure.node.grpc_address, prep.node_id)  # frees its blocks if it lives
        log.warning("request %s: %s (after %d tokens)", prep.client_id, failure.message, len(run.output_ids))
        if (prep.params.n != 1 and yielded) or run.migrations >= cfg.max_migrations or run.aborted:
            return None
        cont = continuation(prep.prompt[: prep.num_prompt_tokens], run.output_ids, prep.params.max_tokens)
        if cont.resumed_output_tokens:
            done = stop_reason(cont.prompt[-1], cont.resumed_output_tokens, len(cont.prompt), prep.params,
                               self.eos_token_ids, cfg.max_model_len)
            if done is not None:
                return done
        run.migrations += 1
        deadline = now + cfg.migration_wait_s
        while True:
            try:
                nxt = await asyncio.to_thread(self._replace, prep, cont, self.exclusions.active(time.monotonic()))
                break
            except NoCapacityError:
                if run.aborted or time.monotonic() >= deadline:
                    return None
                await asyncio.sleep(cfg.node_refresh_s)
        self.metrics.migrated("decode_failed")
        run.trace.migrated("decode_failed", failure.node.node_id, cont.resumed_output_tokens, failure.message)
        log.warning("request %s: continuing on %s after %d tokens (%s)", prep.client_id,
                    nxt.placement.decode_node.node_id, cont.resumed_output_tokens, nxt.placement.reason)
        return nxt

    def _replace(self, prep: Prepared, cont: Continuation, excluded: frozenset) -> Prepared:
        """The continuation placed: a worker thread (the index lookup blocks). No admission
        check: the request was admitted and has a client waiting."""
        view = self.refresher.view
        hashes, placement = self._place(view, cont.prompt, prep.params.n, cont.remaining_tokens, prep.slo_class,
                                        excluded)
        return replace(prep, node_id=_attempt_id(prep.client_id), prompt=cont.prompt, block_hashes=hashes,
                       fingerprint=view.fingerprint, block_size=view.block_size, placement=placement,
                       resumed=cont.resumed_output_tokens)

    def _complete_migrated(self, prep: Prepared, run: Running, reason: FinishReason,
                           arrival: float) -> pb.GenerateResponse:
        t = run.timings
        now = time.monotonic()
        return pb.GenerateResponse(complete=pb.Complete(
            index=0, finish_reason=finish_reason_to_proto(reason),
            usage=pb.Usage(prompt_tokens=prep.num_prompt_tokens, completion_tokens=len(run.output_ids)),
            timings=pb.Timings(queue_s=t.get("queue_s", 0.0), prefill_s=t.get("prefill_s", 0.0),
                               transfer_s=t.get("transfer_s", 0.0),
                               first_token_s=run.first_token_s.get(0, now - arrival), total_s=now - arrival)))

    async def _execute(self, prep: Prepared, run: Running, arrival: float) -> AsyncIterator[pb.GenerateResponse]:
        pl = prep.placement
        decode = pl.decode_node
        run.decode_address = decode.grpc_address
        run.node_request_id = prep.node_id
        run.timings.setdefault("queue_s", time.monotonic() - arrival)
        if run.aborted:  # Abort arrived while the request was being prepared
            for resp in _aborted(prep):
                yield resp
            return
        first: kv_pb2.PrefillResponse | None = None
        if pl.prefill_node is not None:
            first = await self._prefill(prep, pl.prefill_node, decode, run)
            if run.aborted:
                for resp in _aborted(prep):
                    yield resp
                return
        done = self._first_token_finish(prep, first) if first is not None else None
        if done is not None:
            await self._release(decode.grpc_address, prep.node_id)
            for resp in self._complete_here(prep, first, done, arrival):
                yield resp
            return
        dreq = kv_pb2.DecodeRequest(request_id=prep.node_id, prompt_token_ids=prep.prompt, sampling=prep.sampling,
                                    resumed_output_tokens=prep.resumed)
        if first is not None:
            dreq.first_token_ids.extend(first.first_token_ids)
            dreq.cached_prompt_tokens = first.cached_tokens
        async for resp in self._relay(prep, dreq, decode, first, arrival, run):
            yield resp

    async def _prefill(self, prep: Prepared, prefill: NodeInfo, decode: NodeInfo,
                       run: Running) -> kv_pb2.PrefillResponse | None:
        """Reserve on the decode node, prefill on the prefill node. None: prefill locally."""
        cfg = self.config
        kv = kv_pb2_grpc.KVTransferStub(self._channel(decode.grpc_address))
        span = run.trace.client_span("router.prefill", {tracing.PREFILL_NODE: prefill.node_id,
                                                        tracing.DECODE_NODE: decode.node_id})
        md = run.trace.metadata(span)  # both nodes' spans become children of router.prefill
        try:
            reservation = await kv.ReserveBlocks(kv_pb2.ReserveBlocksRequest(
                request_id=prep.node_id, model_fingerprint=prep.fingerprint, block_size=prep.block_size,
                num_tokens=len(prep.prompt), block_hashes=prep.block_hashes, prompt_token_ids=prep.prompt,
            ), timeout=cfg.reserve_timeout_s, metadata=md)
        except grpc.aio.AioRpcError as e:
            node_call_log.warning(f"ReserveBlocks {e.code().name}",
                                  "request %s: ReserveBlocks on %s failed (%s: %s); prefilling on the decode node",
                                  prep.client_id, decode.node_id, e.code().name, e.details())
            run.trace.fallback(span, "reserve_failed", e)
            span.end()
            return None
        call = kv_pb2_grpc.PrefillNodeStub(self._channel(prefill.grpc_address)).Prefill(kv_pb2.PrefillRequest(
            request_id=prep.node_id, prompt_token_ids=prep.prompt, sampling=prep.sampling,
            decode_address=decode.grpc_address, reservation=reservation, resumed_output_tokens=prep.resumed,
        ), timeout=cfg.prefill_timeout_s, metadata=md)
        run.prefill_call = call
        est = prep.placement.estimate
        attempt_id = prep.node_id  # a failure below gives the request a fresh one
        self.ledger.add(prefill.node_id, attempt_id, est.prefill_s if est is not None else 0.0)
        try:
            resp = await self._await_renewing(call, kv, prep.node_id, reservation.lease_s)
            run.trace.prefilled(span, resp)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            await self._release(decode.grpc_address, prep.node_id)
            if isinstance(e, asyncio.CancelledError) or run.aborted:
                if not run.aborted:
                    raise
                return None
            node_call_log.warning(f"Prefill {e.code().name}",
                                  "request %s: Prefill on %s failed (%s: %s); recomputing on decode node %s",
                                  prep.client_id, prefill.node_id, e.code().name, e.details(), decode.node_id)
            run.trace.fallback(span, "prefill_failed", e)
            if is_node_failure(e.code()):
                self.exclusions.exclude(prefill, time.monotonic())
                self.metrics.migrated("prefill_failed")
                run.trace.migrated("prefill_failed", prefill.node_id, prep.resumed, e.details() or "")
            # A fresh id: the failed push may still hold the old reservation on the decode node
            # (it is released when that push ends), and Decode must not wait for it.
            prep.node_id = run.node_request_id = _attempt_id(prep.client_id)
            return None
        finally:
            run.prefill_call = None
            self.ledger.done(prefill.node_id, attempt_id)
            span.end()
        self.accuracy.record(prep.client_id, prep.placement.predicted_cached_tokens, resp.cached_tokens)
        if self.costs is not None:
            learn_transfer(self.costs, prefill.node_id, decode.node_id, resp, prep.block_size)
        run.timings["prefill_s"] = resp.prefill_s
        run.timings["transfer_s"] = resp.transfer_s
        if not run.output_ids:  # a migrated request's first token reached the client long ago
            run.timings["first_token_at"] = time.monotonic()
        return resp

    async def _await_renewing(self, call, kv: kv_pb2_grpc.KVTransferStub, node_request_id: str,
                              lease_s: float) -> kv_pb2.PrefillResponse:
        """Await the Prefill call, renewing the decode node's reservation every third of its
        lease meanwhile. A request can wait in a busy prefill node's queue longer than the lease;
        without renewal its reservation expires, the push is refused and the prompt is computed
        a second time on the decode node."""
        if lease_s <= 0:
            return await call
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=lease_s / 3)
                if done:
                    return task.result()
                try:
                    await kv.RenewReservation(kv_pb2.RenewReservationRequest(request_id=node_request_id),
                                              timeout=self.config.control_timeout_s)
                except grpc.aio.AioRpcError as e:  # the push then fails and the request recomputes
                    node_call_log.warning(f"RenewReservation {e.code().name}", "RenewReservation %s failed: %s",
                                          node_request_id, e.details())
        finally:
            if not task.done():
                task.cancel()

    def _first_token_finish(self, prep: Prepared, first: kv_pb2.PrefillResponse) -> FinishReason | None:
        """Whether the prefill node's token already ends the request, so no decode slot is
        needed: the engine's own stop rule. Stop strings need the decode node's text
        matching, and n > 1 its forks: such requests always go there."""
        p = prep.params
        if p.n != 1 or p.stop or len(first.first_token_ids) != 1:
            return None
        return stop_reason(first.first_token_ids[0], prep.resumed + 1, len(prep.prompt) + 1, p, self.eos_token_ids,
                           self.config.max_model_len)

    def _complete_here(self, prep: Prepared, first: kv_pb2.PrefillResponse, reason: FinishReason,
                       arrival: float):
        tok = first.first_token_ids[0]
        detok = IncrementalDetokenizer(self.tokenizer, prep.prompt)
        text = detok.step([tok]) + detok.flush()
        chunk = pb.Chunk(index=0, token_ids=[tok], text=text)
        if first.first_logprobs:
            chunk.logprobs.append(first.first_logprobs[0])
        now = time.monotonic()
        yield pb.GenerateResponse(chunk=chunk)
        yield pb.GenerateResponse(complete=pb.Complete(
            index=0, finish_reason=finish_reason_to_proto(reason),
            usage=pb.Usage(prompt_tokens=prep.num_prompt_tokens, completion_tokens=prep.resumed + 1,
                           cached_prompt_tokens=first.cached_tokens),
            timings=pb.Timings(queue_s=0.0, prefill_s=first.prefill_s, transfer_s=first.transfer_s,
                               first_token_s=now - arrival, total_s=now - arrival)))

    async def _relay(self, prep: Prepared, dreq: kv_pb2.DecodeRequest, decode: NodeInfo,
                     first: kv_pb2.PrefillResponse | None, arrival: float, run: Running):
        stub = kv_pb2_grpc.DecodeNodeStub(self._channel(decode.grpc_address))
        span = run.trace.client_span("router.decode", {tracing.DECODE_NODE: decode.node_id,
                                                       tracing.RECOMPUTE: first is None})
        call = stub.Decode(dreq, metadata=run.trace.metadata(span))
        sent = 0
        first_token_s = run.first_token_s
        try:
            async for resp in call:
                kind = resp.WhichOneof("kind")
                if kind == "chunk":
                    if resp.chunk.index not in first_token_s:
                        first_token_s[resp.chunk.index] = time.monotonic() - arrival
                    if sent == 0 and first is not None and first.first_logprobs:
                        _prepend_first_logprobs(resp.chunk, first)
                    if prep.params.n == 1:
                        run.output_ids.extend(resp.chunk.token_ids)
                elif kind == "complete":
                    self._fill_complete(resp.complete, run, first, first_token_s, arrival)
                    usage = resp.complete.usage  # a migrated attempt's prompt held earlier output
                    usage.prompt_tokens = prep.num_prompt_tokens
                    usage.cached_prompt_tokens = min(usage.cached_prompt_tokens, prep.num_prompt_tokens)
                elif kind == "error" and is_node_failure(resp.error.code):  # e.g. its engine stopped
                    raise _NodeFailed(decode, f"decode node {decode.node_id}: {resp.error.message}")
                sent += 1
                yield resp
        except grpc.aio.AioRpcError as e:
            run.trace.call_failed(span, e)
            if is_node_failure(e.code()):
                raise _NodeFailed(decode, f"decode node {decode.node_id} failed ({e.code().name}: {e.details()})") \
                    from None
            if sent == 0:
                code = e.code()
                retry = retry_after_ms(e.trailing_metadata()) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and retry is None:
                    retry = self.config.retry_after_ms
                raise RouterError(code, f"decode node {decode.node_id}: {e.details()}", retry) from None
            log.warning("request %s: decode stream from %s broke after output: %s", prep.client_id,
                        decode.node_id, e.details())
            yield pb.GenerateResponse(error=pb.Error(code=e.code().value[0],
                                                     message=f"decode node {decode.node_id}: {e.details()}"))
            for i in range(prep.params.n):
                yield pb.GenerateResponse(complete=pb.Complete(index=i, finish_reason=finish_reason_to_proto(
                    FinishReason.ERROR)))
        finally:
            call.cancel()  # no-op once the stream ended; stops it when we leave it early
            span.end()

    def _fill_complete(self, c: pb.Complete, run: Running, first, first_token_s: dict[int, float],
                       arrival: float) -> None:
        """Router-side timings (all from arrival here) and the prefill node's cache reuse."""
        t = run.timings
        c.timings.queue_s = t.get("queue_s", 0.0)
        c.timings.prefill_s = t.get("prefill_s", c.timings.prefill_s)
        c.timings.transfer_s = t.get("transfer_s", 0.0)
        if "first_token_at" in t:  # the prefill node produced the first token
            c.timings.first_token_s = t["first_token_at"] - arrival
        elif c.index in first_token_s:
            c.timings.first_token_s = first_token_s[c.index]
        c.timings.total_s = time.monotonic() - arrival
        if first is not None:
            c.usage.cached_prompt_tokens = first.cached_tokens

    # -- observability ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Index accuracy (predicted vs reused cached tokens) and freshness (age in seconds of
        each node's newest applied event batch), plus the fitted prefill cost per node and the
        fitted KV transfer cost per (prefill, decode) pair and transport."""
        view = self.refresher.view
        out = {"index_accuracy": self.accuracy.summary(),
               "index_freshness_s": index_freshness(view.nodes, time.time()),
               "inflight": self.inflight}
        if self.costs is not None:
            out["prefill_cost"] = {n.node_id: self.costs.prefill(n.node_id).__repr__()
                                   for n in view.nodes if n.role == Role.PREFILL}
            out["kv_transfer"] = [f._asdict() for f in self.costs.transfer_fits()]
        return out

    # -- abort -------------------------------------------------------------------------------------
    async def abort(self, client_id: str) -> bool:
        run = self._running.get(client_id)
        if run is None:
            return False
        run.aborted = True
        await self._abort_on_nodes(run)
        return True

    async def _abort_on_nodes(self, run: Running) -> None:
        if run.prefill_call is not None:
            run.prefill_call.cancel()
        node_request_id = run.node_request_id
        if node_request_id is None or run.decode_address is None:
            return
        await self._abort_decode(run.decode_address, node_request_id)

    async def _abort_decode(self, address: str, node_request_id: str, quiet: bool = False) -> None:
        stub = kv_pb2_grpc.DecodeNodeStub(self._channel(address))
        try:
            # AbortDecode also drops a reservation, so one call covers every phase.
            await stub.AbortDecode(pb.AbortRequest(request_id=node_request_id), timeout=self.config.control_timeout_s)
        except grpc.aio.AioRpcError as e:
            if quiet:
                log.debug("AbortDecode %s on %s failed: %s", node_request_id, address, e.details())
            else:
                node_call_log.warning(f"AbortDecode {e.code().name}", "AbortDecode %s on %s failed: %s",
                                      node_request_id, address, e.details())

    def _abort_in_background(self, address: str, node_request_id: str) -> None:
        """After a failure: a node that is in fact alive (a broken connection, a failed step)
        frees the request's blocks; a dead one just fails the call. Never awaited by the request."""
        task = asyncio.ensure_future(self._abort_decode(address, node_request_id, quiet=True))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, address: str, node_request_id: str) -> None:
        stub = kv_pb2_grpc.KVTransferStub(self._channel(address))
        try:
            await stub.ReleaseReservation(kv_pb2.ReleaseReservationRequest(request_id=node_request_id),
                                          timeout=self.config.control_timeout_s)
        except grpc.aio.AioRpcError as e:  # the reservation's lease frees it anyway
            node_call_log.warning(f"ReleaseReservation {e.code().name}", "ReleaseReservation %s on %s failed: %s",
                                  node_request_id, address, e.details())

    # -- channels ------------------------------------------------------------------------------------
    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = aio_channel(  # mutual TLS when the config has TLS
                address, self.config.tls, grpc_options(self.config.max_message_bytes))
        return ch

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


def learn_transfer(costs: CostBook, src: str, dst: str, resp: kv_pb2.PrefillResponse, block_size: int) -> None:
    """Teach the cost book one prefill's KV transfer from ``src`` to ``dst``. A node older than
    the transports names none, and could only push over gRPC; one that does not stream (or does
    not report it) leaves ``kv_streamed`` false, and the book then counts the whole transfer as
    waited for. ``transfer_s`` times only the attempts that landed, so a push that fell back
    (``kv_fallbacks``) is a clean sample of the transport that carried it; streamed ones teach
    the exposed share only (CostBook.add_transfer)."""
    costs.add_transfer(src, dst, resp.bytes_sent, resp.transfer_s, num_tokens=resp.blocks_sent * block_size,
                       transport=resp.transport or "grpc", exposed_s=resp.transfer_exposed_s,
                       streamed=resp.kv_streamed, pushes=resp.kv_pushes)


def _attempt_id(client_id: str) -> str:
    """The id the nodes see: unique per attempt, so a retry never meets its own leftovers."""
    return f"{client_id}-{uuid.uuid4().hex[:12]}"


def _aborted(prep: Prepared):
    for i in range(prep.params.n):
        yield pb.GenerateResponse(complete=pb.Complete(
            index=i, finish_reason=finish_reason_to_proto(FinishReason.ABORT),
            usage=pb.Usage(prompt_tokens=prep.num_prompt_tokens)))


def _prepend_first_logprobs(chunk: pb.Chunk, first: kv_pb2.PrefillResponse) -> None:
    """The decode node's first chunk starts with the prefill node's token(s) but cannot know
    their logprobs (the prefill node computed them): put them in front, so every streamed token
    has its logprob."""
    n = len(first.first_logprobs)
    if (list(chunk.token_ids[:n]) == list(first.first_token_ids)
            and len(chunk.logprobs) == len(chunk.token_ids) - n):
        merged = list(first.first_logprobs) + list(chunk.logprobs)
        del chunk.logprobs[:]
        chunk.logprobs.extend(merged)
