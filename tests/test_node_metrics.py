"""Node-side Prometheus metrics: an in-process prefill + decode pair (tiny random model, real
gRPC and Redis, no Ray), driven by hand the way the router drives them, each node's /metrics
scraped over HTTP. Also the per-request recorder and the Ray dashboard figures, without sockets."""
from __future__ import annotations

import urllib.request
from dataclasses import replace

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import SpeculativeConfig
from engine.models.tiny import save_tiny_model
from kv_index.reader import IndexReader
from protos.pdserve.v1 import kv_pb2
from tests.clusters import start_node
from tests.helpers import node_engine_config, tokens_of
from tests.node_pair import NodePair
from tokens.sampling_params import SamplingParams

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# A small vocabulary and a prompt holding every token of it: whatever the model outputs is in
# the context, so the n-gram proposer drafts from the first decode step on.
VOCAB = 64
PROMPT = list(range(VOCAB))


class Pair(NodePair):
    """One prefill and one decode node (the decode one speculating with n-gram lookup); every
    request greedy."""

    def __init__(self, model, redis_url: str) -> None:
        eng = node_engine_config(model, num_blocks=96)
        spec = replace(eng, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False))
        super().__init__(eng, spec, redis_url, prefix="metrics", lease_s=2.0)
        self.model = str(model)

    def prefill_rpc(self, rid, prompt, reservation):
        return super().prefill_rpc(rid, prompt, GREEDY, reservation)

    def decode_rpc(self, rid, prompt, first=(), cached=0):
        return super().decode_rpc(rid, prompt, GREEDY, first, cached)

    def disaggregated(self, rid, prompt):
        pre = self.prefill_rpc(rid, prompt, self.reserve(rid, prompt))
        return pre, self.decode_rpc(rid, prompt, pre.first_token_ids, pre.cached_tokens)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, redis_url):
    p = Pair(save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", vocab_size=VOCAB), redis_url)
    yield p
    p.close()


def scrape(server) -> str:
    with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=5) as resp:
        assert resp.status == 200
        return resp.read().decode()


def samples(text: str) -> list:
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def value(text: str, name: str, **labels) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(s.value for s in samples(text) if s.name == name and labels.items() <= s.labels.items())


NODE_METRICS = (
    "time_to_first_token_seconds_count", "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
    "request_queue_time_seconds_count", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total",
    "request_success_total", "num_preemptions_total", "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total", "kv_transfer_bytes_total",
    "kv_transfer_seconds_count", "kv_transfer_failures_total",
)


def test_metrics_address_is_registered_and_every_name_is_exported(pair):
    live = IndexReader(pair.redis, pair.ns).live_nodes()
    for server in (pair.prefill, pair.decode):
        assert server.metrics_address and server.metrics_address != server.address
        assert live[server.config.node_id].metrics_address == server.metrics_address
        assert server.stats()["metrics_address"] == server.metrics_address
        text = scrape(server)
        names = {s.name for s in samples(text)}
        missing = [n for n in NODE_METRICS if "pdserve:" + n not in names]
        assert not missing, missing
        labels = {"model_name": pair.model, "role": server.role.value, "node_id": server.config.node_id}
        for s in samples(text):
            assert s.name.startswith("pdserve:")
            assert labels.items() <= s.labels.items(), s


def test_the_kernel_plans_matmul_curve_is_registered(pair):
    """The planner's decode fit reads each node's matmul time by batch from the registry
    (kv_index/matmul_curve.py): what its engine's kernel plan measured, row for row."""
    live = IndexReader(pair.redis, pair.ns).live_nodes()
    for server in (pair.prefill, pair.decode):
        plan = server.engine.linear_plan
        assert plan is not None  # CPU, cpu_kernels="auto"
        curve = live[server.config.node_id].matmul_ms
        assert [r for r, _ in curve] == sorted({r for p in plan.shapes.values() for r in p.rows})
        assert [ms for _, ms in curve] == pytest.approx([plan.gemm_ms(r) for r, _ in curve], abs=1e-3)


def test_requests_drive_the_node_metrics(pair):
    before_p, before_d = scrape(pair.prefill), scrape(pair.decode)

    def delta(name, after, before, **labels):
        return value(after, "pdserve:" + name, **labels) - value(before, "pdserve:" + name, **labels)

    # Twice the same prompt (the second prefill hits the prefill node's prefix cache), then a
    # short prompt the decode node prefills itself.
    pres, outs = [], []
    for rid in ("m1", "m2"):
        pre, msgs = pair.disaggregated(rid, PROMPT)
        pres.append(pre)
        outs.append(tokens_of(msgs))
    outs.append(tokens_of(pair.decode_rpc("m3", PROMPT[:10])))
    assert all(len(o) == MAX_TOKENS for o in outs)
    sent = sum(p.bytes_sent for p in pres)
    assert sent > 0
    after_p, after_d = scrape(pair.prefill), scrape(pair.decode)

    # Prefill node: its part of each request ends at the first token and the push.
    for name in ("time_to_first_token_seconds_count", "request_queue_time_seconds_count",
                 "e2e_request_latency_seconds_count", "kv_transfer_seconds_count"):
        assert delta(name, after_p, before_p) == 2, name
    assert delta("inter_token_latency_seconds_count", after_p, before_p) == 0
    assert delta("prompt_tokens_total", after_p, before_p) == 2 * len(PROMPT)
    assert delta("generation_tokens_total", after_p, before_p) == 2
    assert delta("request_success_total", after_p, before_p, finished_reason="prefilled") == 2
    assert delta("kv_transfer_bytes_total", after_p, before_p) == sent
    assert delta("kv_transfer_failures_total", after_p, before_p) == 0
    assert delta("prefix_cache_queries_total", after_p, before_p) >= 2 * len(PROMPT)
    assert delta("prefix_cache_hits_total", after_p, before_p) >= pres[1].cached_tokens > 0
    assert value(after_p, "pdserve:time_to_first_token_seconds_sum") > 0

    # Decode node: three requests to their end, two of them on received KV.
    for name in ("time_to_first_token_seconds_count", "request_queue_time_seconds_count",
                 "e2e_request_latency_seconds_count"):
        assert delta(name, after_d, before_d) == 3, name
    # One observation per token after each request's first (which carried one token).
    assert delta("inter_token_latency_seconds_count", after_d, before_d) == 3 * (MAX_TOKENS - 1)
    assert delta("prompt_tokens_total", after_d, before_d) == 2 * len(PROMPT) + 10
    assert delta("generation_tokens_total", after_d, before_d) == 3 * MAX_TOKENS
    assert delta("request_success_total", after_d, before_d, finished_reason="length") == 3
    assert delta("kv_transfer_bytes_total", after_d, before_d) == sent
    assert delta("kv_transfer_seconds_count", after_d, before_d) == 2
    assert delta("prefix_cache_queries_total", after_d, before_d) > 0
    assert delta("spec_decode_num_drafts_total", after_d, before_d) > 0
    assert delta("spec_decode_num_draft_tokens_total", after_d, before_d) > 0
    assert value(after_d, "pdserve:e2e_request_latency_seconds_sum") > 0
    # Idle again: the gauges come from the engine loop's stats, refreshed as it went idle.
    assert value(after_d, "pdserve:num_requests_running") == 0
    assert value(after_d, "pdserve:kv_cache_usage_perc") == pair.decode.engine.kv.usage
    stats = pair.decode.stats()
    assert stats["prefix_cache_query_tokens"] == value(after_d, "pdserve:prefix_cache_queries_total")
    assert stats["speculative"]["drafts"] == value(after_d, "pdserve:spec_decode_num_drafts_total")


def test_a_refused_transfer_counts_on_both_sides(pair):
    before_p, before_d = scrape(pair.prefill), scrape(pair.decode)
    stats_before = pair.prefill.stats()["transfer_failures"], pair.decode.stats()["transfer_failures"]
    prompt = list(range(30, 53))
    res = pair.reserve("bad", prompt)
    wrong = kv_pb2.ReserveBlocksResponse(num_cached_blocks=res.num_cached_blocks,
                                         block_ids=list(reversed(res.block_ids)), lease_s=res.lease_s,
                                         token=res.token)
    with pytest.raises(grpc.RpcError) as err:
        pair.prefill_rpc("bad", prompt, wrong)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    pair.kv_stub.ReleaseReservation(kv_pb2.ReleaseReservationRequest(request_id="bad"), timeout=10)
    after_p, after_d = scrape(pair.prefill), scrape(pair.decode)
    for after, before in ((after_p, before_p), (after_d, before_d)):
        assert (value(after, "pdserve:kv_transfer_failures_total")
                - value(before, "pdserve:kv_transfer_failures_total")) == 1
        assert value(after, "pdserve:kv_transfer_bytes_total") == value(before, "pdserve:kv_transfer_bytes_total")
    # The same counts in stats(), which the actor copies to the Ray dashboard.
    assert (pair.prefill.stats()["transfer_failures"], pair.decode.stats()["transfer_failures"]) == (
        stats_before[0] + 1, stats_before[1] + 1)
    # The prefill node's request failed: not counted as prefilled.
    assert (value(after_p, "pdserve:request_success_total")
            == value(before_p, "pdserve:request_success_total"))


def test_refused_transfers_are_warned_once_then_counted(pair, monkeypatch, caplog):
    """A decode node that refuses every push fails each request's transfer: the prefill node
    warns once per status, then only counts (DEBUG keeps each), while the metric counts all."""
    import logging

    import prefill_node.server as prefill_server
    from telemetry.log_limit import RateLimitedLog

    now = [0.0]
    monkeypatch.setattr(prefill_server, "transfer_log", RateLimitedLog(prefill_server.log, clock=lambda: now[0]))
    caplog.set_level(logging.DEBUG, logger=prefill_server.log.name)
    before = pair.prefill.stats()["transfer_failures"]

    def refused(rid: str) -> None:
        prompt = list(range(30, 53))
        res = pair.reserve(rid, prompt)
        wrong = kv_pb2.ReserveBlocksResponse(num_cached_blocks=res.num_cached_blocks,
                                             block_ids=list(reversed(res.block_ids)), lease_s=res.lease_s,
                                             token=res.token)
        with pytest.raises(grpc.RpcError) as err:
            pair.prefill_rpc(rid, prompt, wrong)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        pair.kv_stub.ReleaseReservation(kv_pb2.ReleaseReservationRequest(request_id=rid), timeout=10)

    def logged(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == level and "KV transfer of" in r.getMessage()]

    for i in range(3):
        refused(f"flood-{i}")
    assert len(logged(logging.WARNING)) == 1 and len(logged(logging.DEBUG)) == 2
    now[0] = 11.0  # past the 10 s window: the next one logs itself and the count skipped
    refused("flood-3")
    warnings = logged(logging.WARNING)
    assert len(warnings) == 2 and "(and 2 more KV transfer INVALID_ARGUMENT in the last 11 s, not logged)" in warnings[1]
    assert pair.prefill.stats()["transfer_failures"] == before + 4


def test_no_metrics_port_means_no_endpoint_and_none_registered(pair, tmp_path, redis_url):
    node = start_node("decode", "d-quiet", pair.decode.engine.config, redis_url=redis_url, namespace=pair.ns,
                      metrics_port=None, lease_s=2.0, heartbeat_s=0.1)
    try:
        assert node.metrics_address is None and node.metrics_server is None
        assert IndexReader(pair.redis, pair.ns).live_nodes()["d-quiet"].metrics_address == ""
    finally:
        node.stop()


def test_request_recorder_observes_one_request():
    from prometheus_client import CollectorRegistry

    from telemetry.metrics import RequestMetrics
    from telemetry.request_recorder import RequestRecorder

    reg = CollectorRegistry()
    m = RequestMetrics(reg, {"model_name": "m"})
    clock = iter([]).__next__  # every call passes its time explicitly
    rec = RequestRecorder(m, arrival=10.0, clock=clock)
    rec.scheduled(None)
    rec.scheduled(10.5)
    rec.scheduled(10.7)  # only the first scheduled step counts
    rec.sample(0, 0, now=10.8)  # no tokens: nothing
    rec.sample(0, 1, now=11.0)  # first token
    rec.sample(1, 1, now=11.0)  # second sample's first output: no ITL yet
    rec.sample(0, 4, now=12.0)  # 4 tokens after 1 s: 4 observations of 0.25 s (one per token)
    rec.sample(1, 2, "stop", now=12.0)  # 2 of 0.5 s
    rec.sample(0, 0, "length", now=13.0)
    rec.finish(7, now=13.0)
    rec.finish(7, now=14.0)  # idempotent
    get = lambda n, **lb: reg.get_sample_value(n, {"model_name": "m", **lb})  # noqa: E731
    assert get("pdserve:request_queue_time_seconds_count") == 1
    assert get("pdserve:request_queue_time_seconds_sum") == 0.5
    assert get("pdserve:time_to_first_token_seconds_count") == 1
    assert get("pdserve:time_to_first_token_seconds_sum") == 1.0
    assert get("pdserve:inter_token_latency_seconds_count") == 6
    assert get("pdserve:inter_token_latency_seconds_sum") == 4 * 0.25 + 2 * 0.5
    assert get("pdserve:e2e_request_latency_seconds_sum") == 3.0
    assert get("pdserve:prompt_tokens_total") == 7
    assert get("pdserve:generation_tokens_total") == 8
    assert get("pdserve:request_success_total", finished_reason="stop") == 1
    assert get("pdserve:request_success_total", finished_reason="length") == 1


def test_dashboard_values_from_node_stats():
    from node.actor import DASHBOARD_GAUGES, dashboard_values

    v = dashboard_values({"running": 3, "waiting": 1, "kv_usage": 0.25, "running_tokens": 120,
                          "prefix_cache_query_tokens": 200, "prefix_cache_hit_tokens": 50,
                          "speculative": {"draft_tokens": 10, "accepted_tokens": 4}, "transfer_failures": 2})
    assert v == {"pdserve_num_requests_running": 3.0, "pdserve_num_requests_waiting": 1.0,
                 "pdserve_kv_cache_usage_perc": 0.25, "pdserve_running_tokens": 120.0,
                 "pdserve_prefix_cache_hit_ratio": 0.25, "pdserve_spec_decode_acceptance": 0.4,
                 "pdserve_kv_transfer_failures": 2.0}
    assert set(v) <= set(DASHBOARD_GAUGES)
    assert all(":" not in name for name in DASHBOARD_GAUGES)  # Ray refuses ':' in metric names
    # A prefill node before any request: no ratios, no speculation.
    assert set(dashboard_values({"running": 0, "waiting": 0, "kv_usage": 0.0, "running_tokens": 0,
                                 "prefix_cache_query_tokens": 0, "speculative": None})) == {
        "pdserve_num_requests_running", "pdserve_num_requests_waiting", "pdserve_kv_cache_usage_perc",
        "pdserve_running_tokens"}
