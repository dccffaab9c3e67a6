"""OpenTelemetry traces: one trace per request across the router and both nodes.

Off by default. ``setup_tracing`` turns it on in a process when given an OTLP endpoint (or the
standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set), or an exporter (tests: the SDK's in-memory
one). Until then every span comes from the API's no-op tracer: starting one allocates nothing
and ``metadata_for_call`` returns None, so a request pays a few attribute lookups.

The trace context crosses processes as W3C ``traceparent`` / ``tracestate`` in gRPC metadata.
This module stays free of grpc: metadata here is plain ``(key, value)`` tuples, which is what
both grpc and grpc.aio take and give. The SDK and the OTLP exporter (which pulls in grpc) are
imported only when tracing is turned on.

docs/observability.md ("Traces") lists every span, its attributes and events.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

# -- attribute names ---------------------------------------------------------------------------
# OpenTelemetry's GenAI semantic conventions, so trace UIs that know them (Jaeger, Tempo,
# Langfuse...) show model and token counts without configuration.
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
SYSTEM = "pdserve"  # the value of gen_ai.system

# pdserve's own.
REQUEST_ID = "pdserve.request_id"  # the client's id on the router, the per-attempt node id on nodes
CACHED_TOKENS = "pdserve.cached_tokens"  # prompt tokens whose KV was reused, not computed
PREDICTED_CACHED_TOKENS = "pdserve.predicted_cached_tokens"  # what placement expected from the index
PREFILL_NODE = "pdserve.prefill_node"
DECODE_NODE = "pdserve.decode_node"
PLACEMENT = "pdserve.placement"  # "disaggregated", "disaggregated_fetch" or "local" (decode prefills)
PLACEMENT_REASON = "pdserve.placement.reason"
ESTIMATED_TTFT_S = "pdserve.estimate.ttft_s"
SLO_CLASS = "pdserve.slo_class"
RECOMPUTE = "pdserve.recompute"  # the decode node prefills the prompt itself
NODE_ID = "pdserve.node_id"
KV_BYTES = "pdserve.kv.bytes"
KV_BLOCKS = "pdserve.kv.blocks"
KV_CACHED_BLOCKS = "pdserve.kv.cached_blocks"  # blocks the decode node already held: not sent
KV_CHECKSUM_VERIFIED = "pdserve.kv.checksum_verified"
KV_TRANSFER_S = "pdserve.kv.transfer_s"
PREEMPTIONS = "pdserve.preemptions"
ERROR_TYPE = "error.type"  # the gRPC status name of a failure
REASON = "pdserve.reason"

# -- span and event names ----------------------------------------------------------------------
EVENT_FIRST_TOKEN = "first_token"
EVENT_PREEMPTION = "preemption"
EVENT_FALLBACK = "fallback_to_recompute"
EVENT_MIGRATION = "migration"  # a node failed and the request was placed again

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"  # the standard's traces-only override
_TRACER_NAME = "pdserve"
_PROPAGATOR = TraceContextTextMapPropagator()

_lock = threading.Lock()
_provider = None  # the SDK TracerProvider this process exports through, once tracing is on
_tracer: trace.Tracer = trace.NoOpTracer()
_exporters: set = set()  # endpoints and exporters already attached: setup is idempotent
_retired: list = []  # providers shut down by shutdown_tracing (still global, never reused)


def setup_tracing(service_name: str, endpoint: str | None = None, *, exporter=None) -> bool:
    """Turn tracing on for this process if ``endpoint``, ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
    ``exporter`` says so; returns whether tracing is on.

    OpenTelemetry lets a process set its tracer provider once, so the first call that turns
    tracing on fixes ``service_name``; later calls only attach exporters not attached yet (a
    test runs the router and both nodes in one process: their spans share one provider). An
    ``exporter`` is attached with a synchronous processor (spans are visible as soon as they
    end: what tests need); an endpoint gets a batching OTLP/gRPC exporter. A provider the
    application installed itself (e.g. ``opentelemetry-instrument``) is reused, not replaced.
    """
    global _provider, _tracer
    endpoint = endpoint or os.environ.get(TRACES_ENDPOINT_ENV) or os.environ.get(ENDPOINT_ENV) or None
    with _lock:
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return False
        if endpoint is None and exporter is None:
            return _provider is not None
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        if _provider is None:
            current = trace.get_tracer_provider()
            if isinstance(current, TracerProvider) and current not in _retired:
                _provider = current
            else:
                from opentelemetry.sdk.resources import SERVICE_NAME, Resource

                _provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
                # Only while nobody has: OpenTelemetry refuses a second one. Ours serves
                # tracer() either way; the global one only matters to other libraries.
                if isinstance(current, trace.ProxyTracerProvider):
                    trace.set_tracer_provider(_provider)
            _tracer = _provider.get_tracer(_TRACER_NAME)
        if exporter is not None and exporter not in _exporters:
            _exporters.add(exporter)
            _provider.add_span_processor(SimpleSpanProcessor(exporter))
        if endpoint is not None and endpoint not in _exporters:
            _exporters.add(endpoint)
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            # A bare host:port would otherwise mean TLS to the exporter, and an in-cluster
            # collector (the common case) speaks plaintext: say https:// for TLS.
            url = endpoint if "://" in endpoint else f"http://{endpoint}"
            _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
            log.info("tracing on: %s exports OTLP spans to %s", service_name, endpoint)
        return True


def enabled() -> bool:
    return _provider is not None


def tracer() -> trace.Tracer:
    """pdserve's tracer: the no-op one while tracing is off."""
    return _tracer


def flush(timeout_s: float = 5.0) -> None:
    """Export what is buffered (a node that stops must not take its last spans with it)."""
    provider = _provider
    if provider is not None:
        try:
            provider.force_flush(int(timeout_s * 1000))
        except Exception as e:  # a collector that is down must not fail a shutdown
            log.warning("flushing spans failed: %s", e)


def event(name: str, attributes: dict | None = None) -> None:
    """An event on the current span (a step inside a span that is not worth a span)."""
    if _provider is not None:
        trace.get_current_span().add_event(name, attributes)


def annotate(attributes: dict) -> None:
    """Attributes on the current span (what a handler learns once it ran)."""
    if _provider is not None:
        trace.get_current_span().set_attributes(attributes)


def set_error(span: trace.Span, message: str, error_type: str | None = None) -> None:
    """Mark ``span`` failed: status ERROR with ``message``; ``error_type`` is the gRPC status
    name (``error.type`` is what trace UIs group failures by)."""
    span.set_status(trace.Status(trace.StatusCode.ERROR, message))
    if error_type:
        span.set_attribute(ERROR_TYPE, error_type)


def shutdown_tracing() -> None:
    """Export what is buffered and turn pdserve's tracing off again (tests that installed an
    exporter; a process may call setup_tracing afresh afterwards)."""
    global _provider, _tracer
    with _lock:
        provider, _provider, _tracer = _provider, None, trace.NoOpTracer()
        _exporters.clear()
        if provider is not None:
            _retired.append(provider)
    if provider is not None:
        provider.shutdown()


# -- context propagation -----------------------------------------------------------------------
def inject_metadata(metadata: list, context: Context | None = None) -> list:
    """Append ``traceparent`` (and ``tracestate``) of ``context`` (default: the current one)
    to ``metadata``, a list of (key, value) tuples; returns it."""
    if _provider is not None:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=context)
        metadata.extend(carrier.items())
    return metadata


def metadata_for_call(context: Context | None = None) -> tuple[tuple[str, str], ...] | None:
    """The ``metadata=`` of an outgoing gRPC call: the trace context, or None when there is
    none to send (tracing off, no span), so calls carry nothing extra."""
    md = inject_metadata([], context)
    return tuple(md) if md else None


def context_from_metadata(invocation_metadata: Iterable | None) -> Context | None:
    """The caller's trace context from a server's ``context.invocation_metadata()`` (None when
    tracing is off here: spans then need no parent)."""
    if _provider is None or not invocation_metadata:
        return None
    carrier = {}
    for item in invocation_metadata:
        key, value = item[0], item[1]
        if key in ("traceparent", "tracestate"):
            carrier[key] = value.decode() if isinstance(value, bytes) else value
    return _PROPAGATOR.extract(carrier) if carrier else None


# -- time --------------------------------------------------------------------------------------
def clock_offset_ns() -> int:
    """Epoch minus monotonic time, in nanoseconds (read once to convert several stamps alike)."""
    return time.time_ns() - time.monotonic_ns()


def wall_ns(monotonic_s: float, offset_ns: int | None = None) -> int:
    """A ``time.monotonic()`` reading as the epoch nanoseconds spans use: the engine stamps its
    phases on the monotonic clock, and their spans are drawn after the fact. Stamps converted
    with one ``offset_ns`` keep their order exactly (two clock reads do not)."""
    return (clock_offset_ns() if offset_ns is None else offset_ns) + int(monotonic_s * 1e9)
