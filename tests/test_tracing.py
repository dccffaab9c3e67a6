"""OpenTelemetry traces (telemetry/tracing.py): the span tree of one disaggregated request
through an in-process router and real prefill and decode node servers (tiny random model on
CPU, real Redis), the fallback-to-recompute event, rejections, and tracing off.

Tracing is process-wide, so the cluster tests install an in-memory exporter for this module and
turn tracing off again at its end; what must run in a process that never traced (off by
default, OTLP export) runs in a subprocess.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import pdserve
from telemetry import tracing
from tests.clusters import start_node, start_router
from tests.helpers import engine_config, prompt, wait_for

REPO = Path(__file__).resolve().parent.parent
SHORT = 32  # the router's short_prompt_tokens: longer prompts are disaggregated
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env or CLEAN_ENV,
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------ without a cluster
def test_off_by_default_and_nearly_free():
    out = _run("""
        import sys
        from opentelemetry import trace
        import router.orchestrator  # the request path imports tracing
        from telemetry import tracing
        assert tracing.setup_tracing("pdserve-router") is False  # no endpoint, no env
        assert not tracing.enabled()
        with tracing.tracer().start_as_current_span("x") as span:
            assert not span.is_recording()
            assert tracing.metadata_for_call() is None  # calls carry nothing extra
        assert tracing.context_from_metadata([("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")]) is None
        tracing.event("e"); tracing.annotate({"a": 1}); tracing.flush()
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # nothing installed
        lazy = [m for m in sys.modules if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter"))]
        assert not lazy, f"the tracing SDK and exporter are imported only when tracing is on: {lazy}"
        from router.request_trace import RequestTrace
        rt = RequestTrace("m")
        assert not rt.recording and rt.metadata(rt.client_span("c")) is None
        rt.end()
        print("ok")
    """)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


def test_otlp_export_from_the_standard_env_variable():
    """A fake collector (the OTLP TraceService) gets the spans; a bare host:port is plaintext."""
    out = _run("""
        import os
        from concurrent import futures
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts, trace_service_pb2_grpc as tsg

        got = []
        class Collector(tsg.TraceServiceServicer):
            def Export(self, request, context):
                got.append(request)
                return ts.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(2))
        tsg.add_TraceServiceServicer_to_server(Collector(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"127.0.0.1:{port}"
        from telemetry import tracing
        assert tracing.setup_tracing("pdserve-test") is True
        assert tracing.setup_tracing("pdserve-test") is True  # idempotent: one exporter
        with tracing.tracer().start_as_current_span("pdserve.request"):
            pass
        tracing.flush()
        spans = [(r.resource.attributes, s.name) for req in got for r in req.resource_spans
                 for sc in r.scope_spans for s in sc.spans]
        assert [name for _, name in spans] == ["pdserve.request"], spans
        attrs = {a.key: a.value.string_value for a in spans[0][0]}
        assert attrs["service.name"] == "pdserve-test", attrs
        tracing.shutdown_tracing()
        server.stop(0)
        print("ok")
    """)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


def test_decode_stream_trace_marks_preemptions_and_counts_tokens():
    """DecodeStreamTrace on engine outputs, without a node (a preemption is hard to cause on
    purpose through a cluster)."""
    out = _run("""
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from engine.outputs import CompletionOutput, RequestOutput, RequestTimes
        from node.rpc_trace import DecodeStreamTrace
        from telemetry import tracing

        mem = InMemorySpanExporter()
        tracing.setup_tracing("t", exporter=mem)
        metrics = RequestTimes(arrival_time=0.0)
        def out(tokens, pre, finish=None):
            metrics.num_preemptions = pre
            c = CompletionOutput(0, list(range(tokens)), [tokens - 1], "", "", finish_reason=finish)
            return RequestOutput("r", [1, 2], [c], finish is not None, 2, metrics)
        import time
        metrics.arrival_time = time.monotonic()
        metrics.first_scheduled_time = time.monotonic()
        with tracing.tracer().start_as_current_span("decode_node.Decode"):
            d = DecodeStreamTrace()
            for args in ((1, 0), (2, 1), (3, 1), (4, 2, "length")):
                d.output(out(*args))
            d.end()
        spans = {s.name: s for s in mem.get_finished_spans()}
        assert set(spans) == {"decode.queue", "decode", "decode_node.Decode"}, spans
        server = spans["decode_node.Decode"]
        events = [(e.name, dict(e.attributes)) for e in server.events]
        assert events == [("first_token", {}), ("preemption", {"pdserve.preemptions": 1}),
                          ("preemption", {"pdserve.preemptions": 2})], events
        for name in ("decode", "decode_node.Decode"):
            a = spans[name].attributes
            assert a["gen_ai.usage.output_tokens"] == 4 and a["pdserve.preemptions"] == 2, a
            assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",), a
        assert spans["decode"].parent.span_id == server.context.span_id
        assert spans["decode.queue"].end_time <= spans["decode"].start_time + 1
        print("ok")
    """)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


def test_engine_reports_preemptions_per_request(tmp_path):
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import LLMEngine
    from engine.models.tiny import save_tiny_model
    from tokens.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=str(save_tiny_model(tmp_path / "tiny", seed=3)), dtype="float32",
                                 device="cpu", cache=CacheConfig(block_size=4, num_blocks=24),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16)),
                    load_tokenizer=False)
    prompts = [[(i * 37 + j * 11) % 500 + 3 for j in range(20 + i)] for i in range(8)]
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20))
    assert eng.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == eng.scheduler.num_preemptions


# ------------------------------------------------------------------ one traced cluster
@pytest.fixture(scope="module")
def traced(redis_url, tiny_model, tok_dir):
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("OTEL_")}
    mem = InMemorySpanExporter()
    assert tracing.setup_tracing("pdserve-test", exporter=mem)
    ns = f"tr-{uuid.uuid4().hex[:6]}"
    eng = engine_config(tiny_model, num_blocks=128)
    nodes = {role: start_node(role, f"{role}-0", eng, redis_url=redis_url, namespace=ns, lease_s=1.5,
                              heartbeat_s=0.2, grpc_workers=4, metrics_port=None)
             for role in ("prefill", "decode")}
    router = start_router(redis_url, tok_dir, namespace=ns, max_model_len=256, short_prompt_tokens=SHORT,
                          vocab_size=512)
    try:
        with pdserve.Client(router.address) as c:
            # Both nodes in the router's view (a decode node alone already makes it healthy).
            wait_for(lambda: c.health() and {"prefill", "decode"} <= {
                n.role.value for n in router.orchestrator.refresher.view.nodes}, timeout=15, every=0.1)
        yield {"mem": mem, "router": router, "nodes": nodes}
    finally:
        router.stop()
        for s in nodes.values():
            s.stop()
        tracing.shutdown_tracing()
        os.environ.update(saved)


def _request(traced, ids, **kw):
    traced["mem"].clear()
    with pdserve.Client(traced["router"].address, timeout=60, retries=0) as c:
        result = c.complete(token_ids=ids, temperature=0.0, **kw)
    return result, _spans_of_one_trace(traced["mem"])


def _spans_of_one_trace(mem, timeout_s: float = 10.0) -> dict:
    """name -> span, once the root has ended (the nodes end theirs before answering)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spans = mem.get_finished_spans()
        if any(s.name == "pdserve.request" for s in spans):
            break
        time.sleep(0.02)
    spans = mem.get_finished_spans()
    assert len({s.context.trace_id for s in spans}) == 1, [(s.name, s.context.trace_id) for s in spans]
    by_name = {}
    for s in spans:
        assert s.name not in by_name, f"two {s.name} spans"
        by_name[s.name] = s
    return by_name


def _parent(spans, child: str, parent: str) -> None:
    assert spans[child].parent is not None, f"{child} has no parent"
    assert spans[child].parent.span_id == spans[parent].context.span_id, f"{child} is not a child of {parent}"


def test_metadata_round_trip(traced):
    with tracing.tracer().start_as_current_span("caller") as caller:
        md = tracing.metadata_for_call()
    keys = [k for k, _ in md]
    assert keys == ["traceparent"] and md[0][1].startswith(f"00-{caller.get_span_context().trace_id:032x}-")
    # As a server reads it: grpc hands over (key, value) pairs, maybe among others.
    ctx = tracing.context_from_metadata([("user-agent", "x"), *md])
    with tracing.tracer().start_as_current_span("callee", context=ctx) as callee:
        pass
    assert callee.get_span_context().trace_id == caller.get_span_context().trace_id
    assert callee.parent.span_id == caller.get_span_context().span_id
    assert tracing.inject_metadata([("a", "b")])[0] == ("a", "b")


def test_span_tree_of_a_disaggregated_request(traced):
    ids = prompt(1, 100)
    prefills = traced["nodes"]["prefill"].num_prefills
    result, spans = _request(traced, ids, max_tokens=8, ignore_eos=True)
    assert traced["nodes"]["prefill"].num_prefills == prefills + 1, "the request was not disaggregated"
    assert len(result.token_ids) == 8

    expected = {"pdserve.request", "router.place", "router.prefill", "decode_node.ReserveBlocks",
                "prefill_node.Prefill", "prefill.queue", "prefill.compute", "kv_transfer.push",
                "router.decode", "decode_node.Decode", "decode.queue", "decode"}
    assert set(spans) == expected, set(spans) ^ expected
    root = spans["pdserve.request"]
    assert root.parent is None and root.kind == SpanKind.SERVER
    for child in ("router.place", "router.prefill", "router.decode"):
        _parent(spans, child, "pdserve.request")
    _parent(spans, "decode_node.ReserveBlocks", "router.prefill")
    _parent(spans, "prefill_node.Prefill", "router.prefill")
    for child in ("prefill.queue", "prefill.compute", "kv_transfer.push"):
        _parent(spans, child, "prefill_node.Prefill")
    _parent(spans, "decode_node.Decode", "router.decode")
    for child in ("decode.queue", "decode"):
        _parent(spans, child, "decode_node.Decode")
    assert spans["router.prefill"].kind == spans["router.decode"].kind == spans["kv_transfer.push"].kind \
        == SpanKind.CLIENT
    for name in ("prefill_node.Prefill", "decode_node.Decode", "decode_node.ReserveBlocks"):
        assert spans[name].kind == SpanKind.SERVER
    assert all(s.status.status_code != StatusCode.ERROR for s in spans.values())
    # the phases are in order in time
    assert spans["prefill.queue"].end_time <= spans["prefill.compute"].start_time + 1
    assert spans["prefill.compute"].end_time <= spans["kv_transfer.push"].start_time
    assert spans["kv_transfer.push"].end_time <= spans["decode_node.Decode"].start_time
    assert spans["decode.queue"].end_time <= spans["decode"].start_time + 1
    assert root.start_time <= spans["router.place"].start_time and spans["router.decode"].end_time <= root.end_time

    a = root.attributes
    assert a["gen_ai.system"] == "pdserve" and a["gen_ai.request.model"] == "m"
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.usage.input_tokens"] == 100 and a["gen_ai.usage.output_tokens"] == 8
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.request.max_tokens"] == 8 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.top_p"] == 1.0
    assert a["pdserve.placement"] == "disaggregated"
    assert a["pdserve.prefill_node"] == "prefill-0" and a["pdserve.decode_node"] == "decode-0"
    assert a["pdserve.cached_tokens"] == result.usage.cached_prompt_tokens
    assert [e.name for e in root.events] == ["first_token"]
    place = spans["router.place"]
    assert [e.name for e in place.events] == ["tokenized", "index_matched", "placed"]

    push = spans["kv_transfer.push"].attributes
    assert push["pdserve.kv.blocks"] == -(-100 // 16) - push["pdserve.kv.cached_blocks"]
    assert push["pdserve.kv.bytes"] > 0 and push["pdserve.kv.checksum_verified"] is True
    assert push["pdserve.kv.transfer_s"] >= 0
    assert spans["router.prefill"].attributes["pdserve.kv.bytes"] == push["pdserve.kv.bytes"]
    assert spans["prefill_node.Prefill"].attributes["gen_ai.usage.input_tokens"] == 100
    decode = spans["decode_node.Decode"]
    assert decode.attributes["gen_ai.usage.output_tokens"] == 8 and decode.attributes["pdserve.recompute"] is False
    assert tuple(decode.attributes["gen_ai.response.finish_reasons"]) == ("length",)
    assert [e.name for e in decode.events] == ["first_token"]
    assert spans["decode_node.ReserveBlocks"].attributes["pdserve.kv.blocks"] == push["pdserve.kv.blocks"]


def test_failed_transfer_falls_back_to_recompute(traced, monkeypatch):
    from kv_transfer.transport import TransferError

    def broken_push(*args, **kwargs):
        raise TransferError(grpc.StatusCode.DATA_LOSS, "checksum mismatch (injected)")

    monkeypatch.setattr(traced["nodes"]["prefill"].kv_sender, "push", broken_push)
    result, spans = _request(traced, prompt(2, 80), max_tokens=4, ignore_eos=True)
    assert len(result.token_ids) == 4  # served anyway: the decode node recomputed the prompt

    root = spans["pdserve.request"]
    fallback = [e for e in root.events if e.name == "fallback_to_recompute"]
    assert len(fallback) == 1 and fallback[0].attributes["pdserve.reason"] == "prefill_failed"
    assert fallback[0].attributes["error.type"] == "DATA_LOSS"
    assert root.status.status_code != StatusCode.ERROR  # the request itself succeeded
    for name in ("router.prefill", "prefill_node.Prefill", "kv_transfer.push"):
        assert spans[name].status.status_code == StatusCode.ERROR, name
        assert "checksum mismatch" in spans[name].status.description, spans[name].status
    assert spans["prefill_node.Prefill"].attributes["error.type"] == "DATA_LOSS"
    assert spans["decode_node.Decode"].attributes["pdserve.recompute"] is True
    assert spans["router.decode"].attributes["pdserve.recompute"] is True
    assert root.attributes["gen_ai.usage.output_tokens"] == 4


def test_failed_reservation_falls_back_to_recompute(traced, monkeypatch):
    monkeypatch.setattr(traced["nodes"]["decode"].aengine, "reserve_kv", lambda rid, prompt, salt=b"": None)  # pool full
    prefills = traced["nodes"]["prefill"].num_prefills
    result, spans = _request(traced, prompt(6, 90), max_tokens=2, ignore_eos=True)
    assert len(result.token_ids) == 2 and traced["nodes"]["prefill"].num_prefills == prefills
    fallback = [e for e in spans["pdserve.request"].events if e.name == "fallback_to_recompute"]
    assert [e.attributes["pdserve.reason"] for e in fallback] == ["reserve_failed"]
    assert fallback[0].attributes["error.type"] == "RESOURCE_EXHAUSTED"
    assert "prefill_node.Prefill" not in spans
    for name in ("router.prefill", "decode_node.ReserveBlocks"):
        assert spans[name].status.status_code == StatusCode.ERROR and "no room" in spans[name].status.description
    assert spans["decode_node.Decode"].attributes["pdserve.recompute"] is True


def test_rejection_marks_the_root_span(traced):
    traced["mem"].clear()
    with pdserve.Client(traced["router"].address, timeout=30, retries=0) as c:
        with pytest.raises(pdserve.NotFoundError):
            c.complete(token_ids=prompt(3, 10), model="other")
    spans = _spans_of_one_trace(traced["mem"])
    assert set(spans) == {"pdserve.request", "router.place"}
    for s in spans.values():
        assert s.status.status_code == StatusCode.ERROR and "not served here" in s.status.description
        assert s.attributes["error.type"] == "NOT_FOUND"


def test_a_client_traceparent_is_continued(traced):
    """A caller that traces (the SDK under an instrumented app) gets the request in its trace."""
    with tracing.tracer().start_as_current_span("client") as client:
        md = tracing.metadata_for_call()
    traced["mem"].clear()
    with grpc.insecure_channel(traced["router"].address) as ch:
        from protos.pdserve.v1 import serving_pb2 as pb
        from protos.pdserve.v1 import serving_pb2_grpc as pb_grpc

        req = pb.GenerateRequest(tokens=pb.TokenPrompt(ids=prompt(4, 10)),
                                 sampling=pb.SamplingParams(max_tokens=2, temperature=0.0))
        list(pb_grpc.PdServeStub(ch).Generate(req, metadata=md, timeout=60))
    spans = _spans_of_one_trace(traced["mem"])
    root = spans["pdserve.request"]
    assert root.context.trace_id == client.get_span_context().trace_id
    assert root.parent.span_id == client.get_span_context().span_id
    assert root.attributes["pdserve.placement"] == "local"  # 10 tokens < short_prompt_tokens


def test_tracing_off_exports_nothing_and_serves(traced):
    tracing.shutdown_tracing()
    traced["mem"].clear()
    with pdserve.Client(traced["router"].address, timeout=60, retries=0) as c:
        result = c.complete(token_ids=prompt(5, 100), temperature=0.0, max_tokens=3, ignore_eos=True)
    assert len(result.token_ids) == 3
    assert traced["mem"].get_finished_spans() == ()
    assert not tracing.enabled() and tracing.metadata_for_call() is None
