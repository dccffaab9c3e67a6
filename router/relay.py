"""One Decode stream, relayed to the client: the decode node's chunks and Completes go on (with
the router's touches, router/responses.py), its heartbeats stop here, and every wait for the
next message is bounded by the node's own progress (router/liveness.py)::

    read next message --- arrives ---------> heartbeat: drop; chunk/complete: relay; error: classify
         |  every node_refresh_s meanwhile: has the node left the registry (lease lapsed), or
         |  did another stream find it failed? -> NodeFailed (the request moves)
         +- nothing for progress_bound_s -----> NodeFailed(progress_deadline)

A NodeFailed goes up to the orchestrator, which migrates the request (router/migration.py).
Leaving the stream cancels the call, so a node that was only frozen and wakes up later finds
its stream gone: nothing it sends then can reach the client. A message carries the node-side
request id of its attempt and is relayed only while that attempt is the request's current
one, which keeps it so even if a stream were ever read after its attempt was replaced.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from kv_index.nodes import NodeInfo
from protos.conventions import retry_after_ms
from protos.pdserve.v1 import kv_pb2
from protos.pdserve.v1 import serving_pb2 as pb
from router import liveness, responses
from router.config import RouterConfig
from router.migration import Exclusions, NodeFailed, is_node_failure, is_step_error
from router.node_client import NodeClient
from router.node_view import NodeRefresher
from router.request_state import Prepared, Running
from router.validation import RouterError
from telemetry import tracing

log = logging.getLogger(__name__)


class DecodeRelay:
    """Relays Decode streams for the orchestrator (one per router, on its event loop)."""

    def __init__(self, config: RouterConfig, nodes: NodeClient, refresher: NodeRefresher,
                 exclusions: Exclusions) -> None:
        self.config = config
        self.nodes = nodes
        self.refresher = refresher
        self.exclusions = exclusions
        self.heartbeat_s = liveness.heartbeat_period_s(config.decode_progress_floor_s)

    def bound_s(self, decode: NodeInfo) -> float:
        """How long a stream on ``decode`` may stay silent now: from its latest step time in
        the view (the placement's copy if it has left the view)."""
        key = (decode.node_id, decode.grpc_address)
        step_s = next((n.step_s for n in self.refresher.view.nodes if (n.node_id, n.grpc_address) == key),
                      decode.step_s)
        cfg = self.config
        return liveness.progress_bound_s(step_s, cfg.decode_progress_factor, cfg.decode_progress_floor_s,
                                         cfg.decode_progress_ceiling_s)

    def lost(self, decode: NodeInfo, since: float) -> str | None:
        """Why ``decode`` counts as failed without a word from its stream: it left the registry
        (its lease lapsed; draining nodes stay registered), or another stream on it found it
        failed after ``since``. Not while the registry is unreadable or settling after an
        outage (``view.error``): then a missing node says nothing about the node."""
        key = (decode.node_id, decode.grpc_address)
        view = self.refresher.view
        if view.error is None and view.live is not None and key not in view.live:
            return liveness.LEASE_LAPSED
        return self.exclusions.failed_since(key, since)

    async def relay(self, prep: Prepared, dreq: kv_pb2.DecodeRequest, decode: NodeInfo,
                    first: kv_pb2.PrefillResponse | None, run: Running) -> AsyncIterator[pb.GenerateResponse]:
        span = run.trace.client_span("router.decode", {tracing.DECODE_NODE: decode.node_id,
                                                       tracing.RECOMPUTE: first is None})
        dreq.heartbeat_s = self.heartbeat_s
        attempt, since = run.attempt, time.monotonic()
        call = self.nodes.decode(decode.grpc_address, dreq, run.trace.metadata(span))
        sent = 0
        try:
            while (resp := await self._next(call, decode, since)) is not grpc.aio.EOF:
                kind = resp.WhichOneof("kind")
                if kind in ("heartbeat", None) or run.attempt != attempt:
                    continue  # a sign of life (or a member this router does not know): never to the client
                if resp.request_id and resp.request_id != dreq.request_id:
                    log.warning("request %s: dropped a message of node request %r on the stream of %r",
                                prep.client_id, resp.request_id, dreq.request_id)
                    continue
                if kind == "chunk":
                    if resp.chunk.index not in run.first_token_s:
                        run.first_token_s[resp.chunk.index] = time.monotonic() - run.arrival
                    if sent == 0 and first is not None and first.first_logprobs:
                        responses.prepend_first_logprobs(resp.chunk, first)
                    if prep.params.n == 1:
                        run.output_ids.extend(resp.chunk.token_ids)
                elif kind == "complete":
                    responses.fill_relayed_complete(resp.complete, prep, run, first)
                elif kind == "error":
                    _raise_if_node_failed(decode, resp.error.code, resp.error.message)
                sent += 1
                yield resp
        except grpc.aio.AioRpcError as e:
            run.trace.call_failed(span, e)
            reason = liveness.call_failure(e.code(), e.details())
            if reason == liveness.STEP_ERROR:
                _raise_if_node_failed(decode, e.code().value[0], e.details() or "")
            if reason is not None:
                raise NodeFailed(decode, f"decode node {decode.node_id} failed ({e.code().name}: {e.details()})",
                                 reason=reason) from None
            if sent == 0:
                code = e.code()
                retry = retry_after_ms(e.trailing_metadata()) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and retry is None:
                    retry = self.config.retry_after_ms
                raise RouterError(code, f"decode node {decode.node_id}: {e.details()}", retry) from None
            log.warning("request %s: decode stream from %s broke after output: %s", prep.client_id,
                        decode.node_id, e.details())
            for r in responses.error_tail(e.code(), f"decode node {decode.node_id}: {e.details()}", prep.params.n):
                yield r
        finally:
            call.cancel()  # no-op once the stream ended; stops it when we leave it early
            span.end()

    async def _next(self, call, decode: NodeInfo, since: float):
        """The stream's next message (or grpc.aio.EOF), waiting at most the node's progress
        bound and checking every node_refresh_s meanwhile whether the node is lost. Raises
        NodeFailed; leaving early cancels the read, and with it the call."""
        loop = asyncio.get_running_loop()
        bound = self.bound_s(decode)
        deadline = loop.time() + bound
        read = asyncio.ensure_future(call.read())
        try:
            while True:
                left = deadline - loop.time()
                done, _ = await asyncio.wait((read,), timeout=max(0.0, min(left, self.config.node_refresh_s)))
                if done:
                    return read.result()
                why = self.lost(decode, since)
                if why is not None:
                    raise NodeFailed(decode, f"decode node {decode.node_id} failed ({why.replace('_', ' ')})",
                                     reason=why)
                if loop.time() >= deadline:
                    raise NodeFailed(decode, f"decode node {decode.node_id} sent no token and no heartbeat for "
                                             f"{bound:.1f} s (progress deadline)", reason=liveness.PROGRESS_DEADLINE)
        finally:
            if not read.done():
                read.cancel()


def _raise_if_node_failed(decode: NodeInfo, code: int, message: str) -> None:
    """An Error (in the stream, or the call's status) that says the node failed, not the
    request: its engine stopped (UNAVAILABLE) or its step failed (INTERNAL). A step error keeps
    the node's words first ("engine step failed: ..."): if the request cannot move again, that
    is what the client reads."""
    if is_node_failure(code):
        raise NodeFailed(decode, f"decode node {decode.node_id}: {message}")
    if is_step_error(code):
        raise NodeFailed(decode, f"{message} (decode node {decode.node_id})", grpc.StatusCode.INTERNAL,
                         liveness.STEP_ERROR)
