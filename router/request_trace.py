"""The router's part of a request's trace: the root span ``pdserve.request`` and its children
``router.place``, ``router.prefill`` and ``router.decode`` (telemetry/tracing.py has the rest).

The root span is never made the current span: the orchestrator is an async generator, and a
context attached across its ``yield``s would leak into whatever the consumer runs between two
messages, and could not be detached when the generator is finalized from another task. Children
get the root's context explicitly instead (``self.context``), and so does the metadata of each
node call. While tracing is off every method returns at its first line.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from protos.pdserve.v1 import serving_pb2 as pb
from telemetry import tracing as tr

T = TypeVar("T")
_STATUS_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}  # in-stream Error codes are numbers


def finish_reason_name(value: int) -> str:
    """``FINISH_REASON_STOP`` -> "stop" (the GenAI conventions' spelling)."""
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def _error_of(e: BaseException) -> tuple[str, str | None]:
    """(message, gRPC status name) of a RouterError or an AioRpcError; else (repr, class name)."""
    code = getattr(e, "code", None)
    if callable(code):  # grpc.aio.AioRpcError
        return e.details() or "", code().name
    if code is not None and hasattr(e, "message"):  # router.validation.RouterError
        return e.message, code.name
    return str(e) or type(e).__name__, type(e).__name__


class RequestTrace:
    """One request's spans on the router. ``context``: the root's context, the parent of every
    child span and what node calls carry (None while tracing is off)."""

    __slots__ = ("span", "context", "_output_tokens", "_finish", "_cached", "_first")

    def __init__(self, model: str, req: pb.GenerateRequest | None = None, parent: Context | None = None) -> None:
        self._output_tokens = 0
        self._finish: dict[int, str] = {}
        self._cached: int | None = None
        self._first = False
        if not tr.enabled():
            self.span, self.context = trace.INVALID_SPAN, None
            return
        kind = req.WhichOneof("prompt") if req is not None else None
        self.span = tr.tracer().start_span("pdserve.request", context=parent, kind=SpanKind.SERVER, attributes={
            tr.GEN_AI_SYSTEM: tr.SYSTEM, tr.GEN_AI_REQUEST_MODEL: model,
            tr.GEN_AI_OPERATION: "chat" if kind == "chat" else "text_completion",
        })
        self.context = trace.set_span_in_context(self.span)

    @classmethod
    def off(cls) -> RequestTrace:
        """One that records nothing, whatever the process's tracing."""
        self = cls.__new__(cls)
        self.span, self.context = trace.INVALID_SPAN, None
        self._output_tokens, self._finish, self._cached, self._first = 0, {}, None, False
        return self

    @property
    def recording(self) -> bool:
        return self.context is not None

    # -- placement (runs on the worker thread of asyncio.to_thread) -------------------------------
    def place(self, prepare: Callable[..., T], *args) -> T:
        """``prepare(*args)`` inside ``router.place``; the placement lands on the root too.
        The span is current while it runs, so ``prepare`` marks its steps with ``tr.event``."""
        if not self.recording:
            return prepare(*args)
        with tr.tracer().start_as_current_span("router.place", context=self.context, record_exception=False,
                                               set_status_on_exception=False) as span:
            try:
                prep = prepare(*args)
            except Exception as e:
                message, error_type = _error_of(e)
                tr.set_error(span, message, error_type)
                if not hasattr(e, "retry_after_ms"):  # a bug, not a rejection: keep the traceback
                    span.record_exception(e)
                raise
            pl = prep.placement
            attrs = {
                tr.REQUEST_ID: prep.client_id, tr.GEN_AI_USAGE_INPUT_TOKENS: len(prep.prompt),
                tr.GEN_AI_REQUEST_MAX_TOKENS: prep.params.max_tokens,
                tr.GEN_AI_REQUEST_TEMPERATURE: prep.params.temperature, tr.GEN_AI_REQUEST_TOP_P: prep.params.top_p,
                tr.GEN_AI_REQUEST_CHOICE_COUNT: prep.params.n,
                tr.PLACEMENT: pl.kind,
                tr.DECODE_NODE: pl.decode_node.node_id, tr.PREDICTED_CACHED_TOKENS: pl.predicted_cached_tokens,
            }
            if prep.params.seed is not None:
                attrs[tr.GEN_AI_REQUEST_SEED] = prep.params.seed
            if pl.prefill_node is not None:
                attrs[tr.PREFILL_NODE] = pl.prefill_node.node_id
            if pl.estimate is not None:
                attrs[tr.ESTIMATED_TTFT_S] = pl.estimate.ttft_s
            span.set_attributes(attrs)
            span.set_attribute(tr.PLACEMENT_REASON, pl.reason)
            self.span.set_attributes(attrs)
            return prep

    # -- node calls -----------------------------------------------------------------------------------
    def client_span(self, name: str, attributes: dict | None = None) -> trace.Span:
        """A CLIENT child of the root around node calls (the caller ends it)."""
        if not self.recording:
            return trace.INVALID_SPAN
        return tr.tracer().start_span(name, context=self.context, kind=SpanKind.CLIENT, attributes=attributes)

    @staticmethod
    def metadata(span: trace.Span) -> tuple[tuple[str, str], ...] | None:
        """The ``metadata=`` of a call made under ``span``: the node's span becomes its child."""
        if not span.is_recording():
            return None
        return tr.metadata_for_call(trace.set_span_in_context(span))

    @staticmethod
    def prefilled(span: trace.Span, resp) -> None:
        """What the prefill node reports, on ``router.prefill``."""
        if span.is_recording():
            span.set_attributes({tr.CACHED_TOKENS: resp.cached_tokens, tr.KV_BLOCKS: resp.blocks_sent,
                                 tr.KV_BYTES: resp.bytes_sent, tr.KV_TRANSFER_S: resp.transfer_s})

    def fallback(self, span: trace.Span, reason: str, error: BaseException) -> None:
        """The prompt will be recomputed on the decode node: an event on the root (the request
        goes on), the failed call's status on ``span``."""
        if not self.recording:
            return
        message, error_type = _error_of(error)
        tr.set_error(span, message, error_type)
        self.span.add_event(tr.EVENT_FALLBACK, {tr.REASON: reason, tr.ERROR_TYPE: error_type or "",
                                                "message": message})

    def migrated(self, reason: str, failed_node: str, resumed_tokens: int, message: str) -> None:
        """A node failed and the request was placed again (router/migration.py)."""
        if self.recording:
            self.span.add_event(tr.EVENT_MIGRATION, {tr.REASON: reason, tr.NODE_ID: failed_node,
                                                     "pdserve.resumed_tokens": resumed_tokens, "message": message})

    @staticmethod
    def call_failed(span: trace.Span, error: BaseException) -> None:
        if span.is_recording():
            tr.set_error(span, *_error_of(error))

    # -- the client's stream ----------------------------------------------------------------------------
    def feed(self, resp: pb.GenerateResponse) -> None:
        """Each response the client gets: first token, usage, finish reasons, in-stream errors."""
        if not self.recording:
            return
        kind = resp.WhichOneof("kind")
        if kind == "chunk":
            if not self._first and resp.chunk.token_ids:
                self._first = True
                self.span.add_event(tr.EVENT_FIRST_TOKEN)
        elif kind == "complete":
            c = resp.complete
            self._finish[c.index] = finish_reason_name(c.finish_reason)
            self._output_tokens += c.usage.completion_tokens
            self._cached = max(self._cached or 0, c.usage.cached_prompt_tokens)
        elif kind == "error":
            tr.set_error(self.span, resp.error.message, _STATUS_NAMES.get(resp.error.code, str(resp.error.code)))

    def failed(self, error: BaseException) -> None:
        """The request ended by ``error`` (a rejection, a cancel, a bug)."""
        if not self.recording:
            return
        if isinstance(error, asyncio.CancelledError):
            self.span.add_event("cancelled")
        elif isinstance(error, GeneratorExit):
            self.span.add_event("abandoned")  # the front-end stopped reading (client gone)
        else:
            message, error_type = _error_of(error)
            tr.set_error(self.span, message, error_type)
            if not hasattr(error, "retry_after_ms"):
                self.span.record_exception(error)

    def end(self) -> None:
        if not self.recording:
            return
        if self._finish:
            self.span.set_attributes({
                tr.GEN_AI_USAGE_OUTPUT_TOKENS: self._output_tokens,
                tr.GEN_AI_RESPONSE_FINISH_REASONS: [self._finish[i] for i in sorted(self._finish)],
            })
        if self._cached is not None:
            self.span.set_attribute(tr.CACHED_TOKENS, self._cached)
        self.span.end()

