"""Request orchestration: validate -> tokenize -> hash -> one index lookup -> place -> drive
the nodes -> relay the token stream.

Disaggregated path (kv.proto has the wire-level walk-through)::

    ReserveBlocks(decode) -> Prefill(prefill, carries the reservation) -> Decode(decode, first tokens)
          |                       | fails: ReleaseReservation, then Decode without first tokens
          | fails: Decode without first tokens (the decode node prefills; "local")
    first token already ends the request -> ReleaseReservation, complete here

Errors before any output are ``RouterError`` (router/validation.py; the server turns them into
gRPC statuses); after output started they are in-stream ``Error`` messages
(router/responses.py). The node view comes from router/node_view.py (a background thread) so a
request never waits for the registry; the only Redis round trip on the request path is the
prefix match. The calls themselves are router/node_client.py's; the request's state,
router/request_state.py's.

Admission: the global ``max_inflight`` bound, then the policy's estimate against the request's
SLO class (``router.admission.decide``); both reject with RESOURCE_EXHAUSTED and a retry hint.
Index accuracy: every disaggregated request compares the cached tokens placement predicted
with those the prefill node reports it reused (``IndexAccuracy``).

Node failures (router/migration.py): a prefill node that fails leaves the prompt to the decode
node (under a fresh node request id, so a half-written reservation cannot collide); a decode
stream that breaks, before or after output, moves the request: prompt + the tokens already
streamed are placed again, away from the failed node, and the stream goes on where it stopped
(at most ``max_migrations`` times, and only once for a failed engine step)::

    _attempts: _execute(prep) --stream breaks--> _migrate -> _execute(prep') -> ...

A node that fails quietly (frozen, cut off, wedged) is found by keepalive, the Decode
stream's progress deadline, its lapsed lease (router/relay.py) or the Prefill call's deadline
from the cost model (router/liveness.py says which, and how long each wait is).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

import grpc
from opentelemetry.context import Context

from kv_index.nodes import NodeInfo, Role, index_freshness
from protos.pdserve.v1 import kv_pb2
from protos.pdserve.v1 import serving_pb2 as pb
from router import liveness, responses
from router.config import RouterConfig
from router.cost_lessons import learn_fetch, learn_transfer
from router.cost_model import CostBook
from router.index_guard import GuardedLookup
from router.migration import Exclusions, NodeFailed, continuation, is_node_failure, refusal
from router.node_client import NodeClient
from router.node_view import IndexAccuracy, NodeRefresher, PrefillLedger
from router.placement import NoCapacityError, PlacementPolicy
from router.planner.signals import RequestWindow
from router.prepare import Preparer
from router.relay import DecodeRelay
from router.request_metrics import StreamObserver, in_flight_sample
from router.request_state import Prepared, Running, fresh_node_id
from router.request_trace import RequestTrace
from router.tokenizer import PromptTokenizer
from router.validation import RouterError
from telemetry import tracing
from telemetry.log_limit import RateLimitedLog
from telemetry.metrics import (
    MIGRATION_DECODE_FAILED,
    MIGRATION_GAVE_UP,
    MIGRATION_PREFILL_FAILED,
    REJECTED_DUPLICATE_ID,
    REJECTED_OVERLOADED,
    REJECTED_UNAVAILABLE,
    RouterMetrics,
)
from tokens.stop import FinishReason, stop_reason

log = logging.getLogger(__name__)
# Per-request node-call failures (a refused reservation, a full prefill queue) come at the
# request rate under overload: logged once per reason, then a count every 10 s (telemetry/log_limit.py).
node_call_log = RateLimitedLog(log)


class Orchestrator:
    """Serves Generate/Abort. Lives on one asyncio loop; ``Preparer`` runs on a worker thread
    (tokenizing and the Redis lookup block)."""

    def __init__(self, config: RouterConfig, tokenizer: PromptTokenizer, refresher: NodeRefresher,
                 reader: GuardedLookup, policy: PlacementPolicy, costs: CostBook | None = None,
                 metrics: RouterMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else RouterMetrics(config.model_name)
        self.costs = costs
        self.accuracy = IndexAccuracy()
        self.window = RequestWindow()  # finished requests: the planner's signals
        self.ledger = PrefillLedger()
        self.tokenizer = tokenizer
        self.refresher = refresher
        self.policy = policy
        self.preparer = Preparer(config, tokenizer, refresher, reader, policy, self.ledger)
        self.eos_token_ids = frozenset(config.eos_token_ids if config.eos_token_ids is not None
                                       else tokenizer.eos_token_ids)
        self.nodes = NodeClient(config)
        self._running: dict[str, Running] = {}
        self.exclusions = Exclusions(config.exclude_failed_node_s)
        self.relay = DecodeRelay(config, self.nodes, refresher, self.exclusions)
        self.inflight = 0
        # Set by RouterServer.drain: new requests get UNAVAILABLE (another replica takes them),
        # those in flight finish.
        self.draining = False

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
        async with aclosing(self._generate(req, rt, **options)) as stream:
            try:
                async for resp in stream:
                    rt.feed(resp)
                    yield resp
            except BaseException as e:
                rt.failed(e)
                raise
            finally:
                rt.end()

    async def _generate(self, req: pb.GenerateRequest, rt: RequestTrace, *, max_tokens_to_context: bool = False,
                        authorization: str | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """Yield the client's responses. Raises RouterError before the first one.
        ``max_tokens_to_context``: ignore the request's max_tokens and let it use the rest of the
        context (the HTTP API's chat default). ``authorization``: the request's Authorization
        value, whose API key salts its cache blocks (router/prepare.py)."""
        arrival = time.monotonic()
        metrics = self.metrics
        if self.draining:
            metrics.rejected(REJECTED_UNAVAILABLE)
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "this router is shutting down (draining); retry",
                              self.config.retry_after_ms)
        if self.inflight >= self.config.max_inflight:
            metrics.rejected(REJECTED_OVERLOADED)
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{self.inflight} requests in flight (max_inflight {self.config.max_inflight}); "
                              f"retry after {self.config.retry_after_ms} ms", self.config.retry_after_ms)
        client_id = req.request_id if req.HasField("request_id") and req.request_id else uuid.uuid4().hex
        if client_id in self._running:
            metrics.rejected(REJECTED_DUPLICATE_ID)
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"request id {client_id!r} is already running")
        self.inflight += 1
        self.window.arrived(time.time())
        metrics.running.inc()
        run = self._running[client_id] = Running(arrival, trace=rt)
        observer = StreamObserver(metrics.requests, arrival)
        sent = False
        first: float | None = None  # its TTFT, once its first token came
        try:
            # to_thread runs it in a copy of this task's context: router.place is current there
            prep = await asyncio.to_thread(rt.place, self.preparer.prepare, req, client_id, max_tokens_to_context,
                                           self.exclusions.active(time.monotonic()), authorization)
            metrics.decision(prep.placement.kind)
            self.window.started(client_id, in_flight_sample(prep))
            async for resp in self._attempts(prep, run):
                if not sent:
                    sent = True
                    observer.queued(run.queue_s or 0.0)
                resp.request_id = client_id
                observer.feed(resp)
                if first is None and (first := observer.ttft_s) is not None:
                    self.window.first_token(client_id, first)
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
                self.window.add(observer.planner_sample(prep.placement, prep.slo_class))
            self.window.ended(client_id)
            self.inflight -= 1
            metrics.running.dec()
            self._running.pop(client_id, None)

    async def _attempts(self, prep: Prepared, run: Running) -> AsyncIterator[pb.GenerateResponse]:
        """``_execute``, and again elsewhere each time a node fails (router/migration.py)."""
        yielded = False
        while True:
            try:
                async for resp in self._execute(prep, run):
                    yielded = True
                    yield resp
                return
            except NodeFailed as e:
                failure = e  # the except clause unbinds its own name
                outcome = await self._migrate(prep, run, failure, yielded)
            except RouterError as e:  # a later attempt refused before its output: the client has some
                if not yielded:
                    raise
                failure = NodeFailed(prep.placement.decode_node, e.message, e.code)
                outcome = None
            if isinstance(outcome, Prepared):
                prep = outcome
                continue
            if run.aborted:
                tail = responses.aborted(prep)
            elif isinstance(outcome, FinishReason):  # the node died between the last token and its Complete
                usage = pb.Usage(prompt_tokens=prep.num_prompt_tokens, completion_tokens=len(run.output_ids))
                tail = [responses.complete(0, outcome, usage, run.timings(0))]
            else:
                self.metrics.migrated(MIGRATION_GAVE_UP)
                if not yielded:
                    raise RouterError(failure.code, failure.message)
                tail = responses.error_tail(failure.code, failure.message, prep.params.n)
            for resp in tail:
                yield resp
            return

    async def _migrate(self, prep: Prepared, run: Running, failure: NodeFailed,
                       yielded: bool) -> Prepared | FinishReason | None:
        """The next attempt after ``failure``: placed away from the failed node, continuing
        after the tokens already streamed. A FinishReason when those tokens already end the
        request; None when it cannot move (n > 1 after output, no migration left, no live
        node in time)."""
        cfg = self.config
        now = time.monotonic()
        self.metrics.node_failure(failure.reason)
        self.exclusions.exclude(failure.node, now, failure.reason if failure.reason in liveness.NODE_WIDE else None)
        # Frees its blocks if it lives. The run's id, not prep's: a failed prefill renamed the attempt.
        self.nodes.abort_in_background(failure.node.grpc_address, run.node_request_id or prep.node_id)
        log.warning("request %s: %s (after %d tokens)", prep.client_id, failure.message, len(run.output_ids))
        step_error = failure.reason == liveness.STEP_ERROR
        run.step_errors += step_error
        why_not = refusal(step_error=step_error, n=prep.params.n, yielded=yielded, migrations=run.migrations,
                          max_migrations=cfg.max_migrations, step_errors=run.step_errors, aborted=run.aborted)
        if why_not is not None:
            log.warning("request %s cannot move: %s", prep.client_id, why_not)
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
                nxt = await asyncio.to_thread(self.preparer.place_continuation, prep, cont,
                                              self.exclusions.active(time.monotonic()))
                break
            except NoCapacityError:
                if run.aborted or time.monotonic() >= deadline:
                    return None
                await asyncio.sleep(cfg.node_refresh_s)
        self.metrics.migrated(MIGRATION_DECODE_FAILED)
        run.trace.migrated(MIGRATION_DECODE_FAILED, failure.node.node_id, cont.resumed_output_tokens, failure.message)
        log.warning("request %s: continuing on %s after %d tokens (%s)", prep.client_id,
                    nxt.placement.decode_node.node_id, cont.resumed_output_tokens, nxt.placement.reason)
        return nxt

    async def _execute(self, prep: Prepared, run: Running) -> AsyncIterator[pb.GenerateResponse]:
        pl = prep.placement
        decode = pl.decode_node
        run.attempt += 1
        run.decode_address = decode.grpc_address
        run.node_request_id = prep.node_id
        if run.queue_s is None:
            run.queue_s = time.monotonic() - run.arrival
        first: kv_pb2.PrefillResponse | None = None
        if pl.prefill_node is not None and not run.aborted:
            prep, first = await self._prefill(prep, pl.prefill_node, decode, run)
        if run.aborted:  # Abort arrived while the request was being prepared or prefilled
            for resp in responses.aborted(prep):
                yield resp
            return
        done = self._first_token_finish(prep, first) if first is not None else None
        if done is not None:
            await self.nodes.release(decode.grpc_address, prep.node_id)
            for resp in responses.completed_by_prefill(prep, first, done, run, self.tokenizer):
                yield resp
            return
        dreq = kv_pb2.DecodeRequest(request_id=prep.node_id, prompt_token_ids=prep.prompt, sampling=prep.sampling,
                                    resumed_output_tokens=prep.resumed, cache_salt=prep.cache_salt)
        if first is not None:
            dreq.first_token_ids.extend(first.first_token_ids)
            dreq.cached_prompt_tokens = first.cached_tokens
        async for resp in self.relay.relay(prep, dreq, decode, first, run):
            yield resp

    async def _prefill(self, prep: Prepared, prefill: NodeInfo, decode: NodeInfo,
                       run: Running) -> tuple[Prepared, kv_pb2.PrefillResponse | None]:
        """Reserve on the decode node, prefill on the prefill node. The attempt goes on as the
        Prepared returned (a fresh node id after a failed prefill); the response None: the
        decode node prefills."""
        span = run.trace.client_span("router.prefill", {tracing.PREFILL_NODE: prefill.node_id,
                                                        tracing.DECODE_NODE: decode.node_id})
        md = run.trace.metadata(span)  # both nodes' spans become children of router.prefill
        try:
            reservation = await self.nodes.reserve(decode.grpc_address, kv_pb2.ReserveBlocksRequest(
                request_id=prep.node_id, model_fingerprint=prep.fingerprint, block_size=prep.block_size,
                num_tokens=len(prep.prompt), block_hashes=prep.block_hashes, prompt_token_ids=prep.prompt,
                cache_salt=prep.cache_salt), md)
        except grpc.aio.AioRpcError as e:
            node_call_log.warning(f"ReserveBlocks {e.code().name}",
                                  "request %s: ReserveBlocks on %s failed (%s: %s); prefilling on the decode node",
                                  prep.client_id, decode.node_id, e.code().name, e.details())
            run.trace.fallback(span, "reserve_failed", e)
            span.end()
            return prep, None
        est = prep.placement.estimate
        cfg = self.config
        holder, fetch = self._fetch_spec(prep)
        # A fetch past its bound is computed: the deadline leaves room for both.
        deadline_s = liveness.prefill_deadline_s(est, cfg.prefill_deadline_factor, cfg.prefill_deadline_floor_s,
                                                 cfg.prefill_timeout_s) + (fetch.timeout_s if fetch else 0.0)
        started = time.monotonic()
        call = run.prefill_call = self.nodes.prefill(prefill.grpc_address, kv_pb2.PrefillRequest(
            request_id=prep.node_id, prompt_token_ids=prep.prompt, sampling=prep.sampling,
            decode_address=decode.grpc_address, reservation=reservation, resumed_output_tokens=prep.resumed,
            fetch=fetch, cache_salt=prep.cache_salt), md, timeout_s=deadline_s)
        self.ledger.add(prefill.node_id, prep.node_id, est.prefill_s if est is not None else 0.0)
        try:
            resp = await self.nodes.prefilled(call, decode.grpc_address, prep.node_id, reservation.lease_s)
            run.trace.prefilled(span, resp)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            await self.nodes.release(decode.grpc_address, prep.node_id)
            if isinstance(e, asyncio.CancelledError) or run.aborted:
                if not run.aborted:
                    raise
                return prep, None
            node_call_log.warning(f"Prefill {e.code().name}",
                                  "request %s: Prefill on %s failed (%s: %s); recomputing on decode node %s",
                                  prep.client_id, prefill.node_id, e.code().name, e.details(), decode.node_id)
            run.trace.fallback(span, "prefill_failed", e)
            reason = _prefill_failure(e, time.monotonic() - started, deadline_s)
            if reason is not None:
                self.exclusions.exclude(prefill, time.monotonic())
                self.metrics.node_failure(reason)
                self.metrics.migrated(MIGRATION_PREFILL_FAILED)
                run.trace.migrated(MIGRATION_PREFILL_FAILED, prefill.node_id, prep.resumed, e.details() or "")
            # A fresh id: the failed push may still hold the old reservation on the decode node
            # (it is released when that push ends), and Decode must not wait for it.
            fresh = replace(prep, node_id=fresh_node_id(prep.client_id))
            run.node_request_id = fresh.node_id
            return fresh, None
        finally:
            run.prefill_call = None
            self.ledger.done(prefill.node_id, prep.node_id)
            span.end()
        self.accuracy.record(prep.client_id, prep.placement.predicted_cached_tokens, resp.cached_tokens)
        if self.costs is not None:
            learn_transfer(self.costs, prefill.node_id, decode.node_id, resp, prep.block_size)
            if holder is not None:
                learn_fetch(self.costs, holder.node_id, prefill.node_id, resp, prep.placement.fetch_tokens)
        run.prefill_s, run.transfer_s = resp.prefill_s, resp.transfer_s
        if not run.output_ids:  # a migrated request's first token reached the client long ago
            run.prefill_token_at = time.monotonic()
        return prep, resp

    def _fetch_spec(self, prep: Prepared) -> tuple[NodeInfo | None, kv_pb2.KVFetch | None]:
        """The holder placement chose to fetch the prompt's head from, and what the prefill node
        is asked to fetch (None, None: nothing, or the holder left the view since)."""
        pl = prep.placement
        if pl.fetch_from is None or pl.fetch_tokens <= 0:
            return None, None
        holder = next((n for n in self.refresher.view.nodes if n.node_id == pl.fetch_from), None)
        if holder is None:
            return None, None
        return holder, kv_pb2.KVFetch(holder_address=holder.grpc_address,
                                      num_blocks=pl.predicted_cached_tokens // prep.block_size,
                                      timeout_s=liveness.fetch_timeout_s(pl.estimate))

    def _first_token_finish(self, prep: Prepared, first: kv_pb2.PrefillResponse) -> FinishReason | None:
        """Whether the prefill node's token already ends the request, so no decode slot is
        needed: the engine's own stop rule. Stop strings need the decode node's text
        matching, and n > 1 its forks: such requests always go there."""
        p = prep.params
        if p.n != 1 or p.stop or len(first.first_token_ids) != 1:
            return None
        return stop_reason(first.first_token_ids[0], prep.resumed + 1, len(prep.prompt) + 1, p, self.eos_token_ids,
                           self.config.max_model_len)

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
        if run.node_request_id is not None and run.decode_address is not None:
            await self.nodes.abort_decode(run.decode_address, run.node_request_id)

    async def close(self) -> None:
        await self.nodes.close()


def _prefill_failure(e: grpc.aio.AioRpcError, elapsed_s: float, deadline_s: float) -> str | None:
    """Whether a failed Prefill call says its node failed (router/liveness.py reasons): gone,
    unanswered keepalive, or past the deadline this router gave it (a DEADLINE_EXCEEDED the
    node reports about its own push to the decode node is not the prefill node's fault)."""
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return liveness.PREFILL_DEADLINE if elapsed_s >= 0.95 * deadline_s else None
    return liveness.call_failure(e.code(), e.details()) if is_node_failure(e.code()) else None
