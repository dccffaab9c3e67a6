"""Node-side spans: a SERVER span per traced RPC, parented by the caller's trace context from
the gRPC metadata, and the engine's phases drawn after the fact from its timestamps.

``traced_rpc`` wraps a servicer method. While tracing is off it calls the method as is (a
streaming handler's generator is returned untouched), so an untraced node pays one check per
RPC. A unary handler runs inside its span (current: children need no plumbing). A streaming
handler's span is made current only around each step of its generator: a context attached for
the whole stream would still be attached whenever grpc runs between two messages, and could not
be detached if the stream is abandoned and closed by the garbage collector on another thread.

An aborted RPC (``context.abort`` raises a bare Exception after recording the status) gets the
status and details it was aborted with.
"""
from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from telemetry import tracing as tr

if TYPE_CHECKING:
    from engine.outputs import RequestOutput


def _mark_failed(span: trace.Span, context, error: BaseException) -> None:
    code = context.code() if hasattr(context, "code") else None
    if code is not None:  # context.abort(code, details)
        details = context.details() if hasattr(context, "details") else b""
        if isinstance(details, bytes):
            details = details.decode(errors="replace")
        tr.set_error(span, details or code.name, code.name)
    else:
        tr.set_error(span, str(error) or type(error).__name__, type(error).__name__)
        span.record_exception(error)


def traced_rpc(name: str, attributes: Callable[[object], dict] | None = None):
    """Decorate ``method(self, request, context)`` with a SERVER span ``name``;
    ``attributes(request)`` gives its first attributes."""

    def wrap(method):
        streaming = inspect.isgeneratorfunction(method)

        @functools.wraps(method)
        def handler(self, request, context):
            if not tr.enabled():
                return method(self, request, context)
            span = tr.tracer().start_span(
                name, context=tr.context_from_metadata(context.invocation_metadata()), kind=SpanKind.SERVER,
                attributes=attributes(request) if attributes is not None else None)
            if streaming:
                return _stream_in_span(span, method(self, request, context), context)
            token = otel_context.attach(trace.set_span_in_context(span))
            try:
                return method(self, request, context)
            except BaseException as e:
                _mark_failed(span, context, e)
                raise
            finally:
                otel_context.detach(token)
                span.end()

        return handler

    return wrap


def _stream_in_span(span: trace.Span, gen, context):
    ctx = trace.set_span_in_context(span)
    try:
        while True:
            token = otel_context.attach(ctx)
            try:
                item = next(gen)
            except StopIteration:
                return
            finally:
                otel_context.detach(token)
            yield item
    except GeneratorExit:  # the client went away (grpc stopped reading)
        span.add_event("cancelled")
        raise
    except BaseException as e:
        _mark_failed(span, context, e)
        raise
    finally:
        gen.close()
        span.end()


@contextmanager
def child_span(name: str, context, attributes: dict | None = None, kind: SpanKind = SpanKind.INTERNAL):
    """A child of the current span around a step of a unary RPC (a failure inside, abort
    included, marks it)."""
    if not tr.enabled():
        yield trace.INVALID_SPAN
        return
    with tr.tracer().start_as_current_span(name, kind=kind, attributes=attributes, record_exception=False,
                                           set_status_on_exception=False) as span:
        try:
            yield span
        except BaseException as e:
            _mark_failed(span, context, e)
            raise


def engine_phase(name: str, start_ns: int, end_ns: int, attributes: dict | None = None,
                 parent: trace.Span | None = None) -> trace.Span:
    """A finished child span between two epoch-ns times; of ``parent``, else of the current span."""
    ctx = trace.set_span_in_context(parent) if parent is not None else None
    span = tr.tracer().start_span(name, context=ctx, start_time=start_ns, attributes=attributes)
    span.end(end_time=max(start_ns, end_ns))
    return span


def prefill_phases(arrival_s: float, final: RequestOutput) -> None:
    """``prefill.queue`` (arrival at the node -> the engine first schedules the request) and
    ``prefill.compute`` (-> its first token), children of the current (Prefill) span."""
    if not tr.enabled():
        return
    m = final.metrics
    offset = tr.clock_offset_ns()
    started_s = m.first_scheduled_time if m.first_scheduled_time is not None else arrival_s
    arrival = tr.wall_ns(arrival_s, offset)
    started = max(arrival, tr.wall_ns(started_s, offset))
    done = tr.wall_ns(m.first_token_time, offset) if m.first_token_time is not None else started
    engine_phase("prefill.queue", arrival, started)
    trace.get_current_span().set_attribute(tr.CACHED_TOKENS, final.num_cached_tokens)
    compute = {tr.CACHED_TOKENS: final.num_cached_tokens,
               "pdserve.computed_tokens": len(final.prompt_token_ids) - final.num_cached_tokens}
    if m.num_preemptions:
        compute[tr.PREEMPTIONS] = m.num_preemptions
    engine_phase("prefill.compute", started, done, compute)
    if m.num_preemptions:
        # The engine does not stamp when; the event marks that the prefill was recomputed.
        trace.get_current_span().add_event(tr.EVENT_PREEMPTION, {tr.PREEMPTIONS: m.num_preemptions},
                                           timestamp=done)


class DecodeStreamTrace:
    """The decode node's view of one Decode stream, fed each engine output: ``decode.queue``
    (arrival -> first scheduled), a ``first_token`` event, ``decode`` (-> the last output),
    ``preemption`` events, and token counts and finish reasons on the Decode span. Built inside
    the stream, where the Decode span is current."""

    __slots__ = ("server", "arrival_ns", "decode", "preemptions", "tokens", "finish", "cached")

    def __init__(self) -> None:
        span = trace.get_current_span()
        self.server = span if span.is_recording() else None
        self.arrival_ns = getattr(span, "start_time", None)
        self.decode: trace.Span | None = None
        self.preemptions = 0
        self.tokens: dict[int, int] = {}
        self.finish: dict[int, str] = {}
        self.cached = 0

    def output(self, out: RequestOutput) -> None:
        server = self.server
        if server is None:
            return
        m = out.metrics
        if self.decode is None:
            started = m.first_scheduled_time
            start_ns = tr.wall_ns(started) if started is not None else time.time_ns()
            arrival_ns = self.arrival_ns if self.arrival_ns is not None else tr.wall_ns(m.arrival_time)
            ctx = trace.set_span_in_context(server)
            queue = tr.tracer().start_span("decode.queue", context=ctx, start_time=min(arrival_ns, start_ns))
            queue.end(end_time=start_ns)
            self.decode = tr.tracer().start_span("decode", context=ctx, start_time=start_ns)
            server.add_event(tr.EVENT_FIRST_TOKEN)
        if m.num_preemptions > self.preemptions:
            self.preemptions = m.num_preemptions
            # Seen with the first output after the recompute: the engine does not stamp when.
            server.add_event(tr.EVENT_PREEMPTION, {tr.PREEMPTIONS: m.num_preemptions})
        for c in out.outputs:
            self.tokens[c.index] = len(c.token_ids)
            if c.finish_reason:
                self.finish[c.index] = c.finish_reason
        self.cached = out.num_cached_tokens

    def failed(self, message: str, error_type: str) -> None:
        """The stream broke after output (its status stays OK: the error is in-stream)."""
        if self.server is not None:
            tr.set_error(self.server, message, error_type)
            if self.decode is not None:
                tr.set_error(self.decode, message, error_type)

    def end(self) -> None:
        if self.server is None:
            return
        attrs = {tr.GEN_AI_USAGE_OUTPUT_TOKENS: sum(self.tokens.values()), tr.CACHED_TOKENS: self.cached}
        if self.finish:
            attrs[tr.GEN_AI_RESPONSE_FINISH_REASONS] = [self.finish[i] for i in sorted(self.finish)]
        if self.preemptions:
            attrs[tr.PREEMPTIONS] = self.preemptions
        self.server.set_attributes(attrs)
        if self.decode is not None:
            self.decode.set_attributes(attrs)
            self.decode.end()
            self.decode = None
