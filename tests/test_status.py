"""`pdserve status` (deploy/status.py): metrics text -> figures -> report -> table, without
sockets; then one `pdserve status --json` against in-process nodes, a real Redis and a router
/metrics endpoint."""
from __future__ import annotations

import json
import time
import uuid

import grpc
import pytest
from prometheus_client import generate_latest

from deploy.status import (
    Sample,
    build_report,
    metrics_url,
    node_row,
    parse_metrics,
    prometheus_targets,
    recent_errors,
    render,
)
from kv_index.nodes import NodeInfo
from telemetry.metrics import MetricsServer, NodeMetrics, RouterMetrics

STATS = {"running": 2, "waiting": 1, "kv_usage": 0.5, "preemptions": 3, "prefix_cache_query_tokens": 400,
         "prefix_cache_hit_tokens": 100, "speculative": {"drafts": 5, "draft_tokens": 20, "accepted_tokens": 15}}


def node_text(role="decode", node_id="d0", stats=STATS, transfer_bytes=0, failures=0, reasons=()) -> str:
    m = NodeMetrics("m", role, node_id, engine_stats=lambda: stats)
    m.transfer_bytes.inc(transfer_bytes)
    m.transfer_failures.inc(failures)
    m.transfer_seconds.observe(0.01)
    for r in reasons:
        m.requests.success(r)
    m.requests.ttft.observe(0.2)
    m.requests.ttft.observe(0.4)
    m.requests.prompt_tokens.inc(50)
    return generate_latest(m.registry).decode()


def info(node_id="d0", role="decode", **kw) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, grpc_address="127.0.0.1:1", fingerprint="f", block_size=16,
                    num_blocks=100, metrics_address="127.0.0.1:2", **kw)


def test_parse_metrics_reads_every_figure():
    f = parse_metrics(node_text(transfer_bytes=3_000_000, failures=2, reasons=("stop", "stop", "abort")))
    assert f["running"] == 2 and f["waiting"] == 1 and f["kv_usage"] == 0.5 and f["preemptions"] == 3
    assert f["prefix_cache_queries"] == 400 and f["prefix_cache_hits"] == 100
    assert (f["spec_drafts"], f["spec_draft_tokens"], f["spec_accepted_tokens"]) == (5, 20, 15)
    assert f["transfer_bytes"] == 3_000_000 and f["transfer_failures"] == 2 and f["transfers"] == 1
    # Declared reasons show at 0 before any request.
    assert f["requests"] == {"stop": 2, "abort": 1, "length": 0}
    assert f["ttft_count"] == 2 and f["ttft_sum"] == pytest.approx(0.6)
    assert f["prompt_tokens"] == 50
    assert "index_accuracy" not in f


def test_parse_router_metrics_index_figures():
    m = RouterMetrics("m")
    m.watch_index(lambda: {"d0": 0.5, "p0": 1.5}, lambda: 0.75)
    f = parse_metrics(generate_latest(m.registry).decode())
    assert f["index_accuracy"] == 0.75
    assert f["index_freshness_s"] == {"d0": 0.5, "p0": 1.5}


def test_node_row_ratios_rates_and_fallback():
    now = 1000.0
    first = Sample(10.0, parse_metrics(node_text(transfer_bytes=1_000_000)))
    second = Sample(12.0, parse_metrics(node_text(transfer_bytes=5_000_000, failures=1, reasons=("abort",))))
    row = node_row(info(updated_at=999.5), now, second)
    assert row["source"] == "metrics" and row["last_seen_s"] == 0.5
    assert row["prefix_cache_hit_ratio"] == 0.25 and row["spec_acceptance"] == 0.75
    assert row["transfer_mb_s"] is None and row["transfer_bytes"] == 5_000_000  # one scrape: no rate
    assert row["mean_ttft_s"] == pytest.approx(0.3)
    rated = node_row(info(updated_at=999.5), now, second, prev=first)
    assert rated["transfer_mb_s"] == pytest.approx(2.0)  # 4 MB in 2 s
    assert rated["new_transfer_failures"] == 1 and rated["new_aborts"] == 1
    assert recent_errors([rated]) == ["d0: 1 new KV transfer failure(s) (1 in all)", "d0: 1 new aborted request(s)"]
    assert recent_errors([row]) == ["d0: 1 KV transfer failure(s) since start", "d0: 1 aborted request(s) since start"]
    # A prefill node that drafted nothing: no acceptance figure, not 0.
    idle = node_row(info("p0", "prefill"), now, Sample(1.0, parse_metrics(node_text("prefill", "p0", {
        **STATS, "prefix_cache_query_tokens": 0, "prefix_cache_hit_tokens": 0, "speculative": None}))))
    assert idle["prefix_cache_hit_ratio"] is None and idle["spec_acceptance"] is None
    assert idle["requests"] == {"prefilled": 0}
    # Unreachable /metrics: the heartbeat's load, flagged.
    down = node_row(info(running=4, waiting=2, kv_usage=0.1, updated_at=990.0), now, None, error="refused")
    assert (down["source"], down["running"], down["waiting"], down["last_seen_s"]) == ("registry", 4, 2, 10.0)
    assert "refused" in recent_errors([down])[0]


def test_report_and_table():
    now = time.time()
    nodes = {"d0": info("d0", "decode", updated_at=now - 0.2, event_at=now - 1.0),
             "p0": info("p0", "prefill", updated_at=now - 0.3, event_at=now - 2.0),
             "p1": info("p1", "prefill", updated_at=now - 5.0)}
    scrapes = {"d0": Sample(2.0, parse_metrics(node_text(transfer_bytes=2048))),
               "p0": Sample(2.0, parse_metrics(node_text("prefill", "p0", transfer_bytes=2048))),
               "p1": "URLError: refused"}
    router = Sample(2.0, {"index_accuracy": 0.9, "running": 1.0})
    index = {"blocks": 12, "blocks_complete": True, "entries": {"d0": 5, "p0": 9}, "redis_bytes": 2800,
             "bytes_per_entry": 200.0, "bytes_per_cached_token": 12.5}
    report = build_report(nodes, scrapes, now=now, index=index, router=router,
                          cluster={"grpc": "127.0.0.1:50051", "namespace": "ns"})
    json.dumps(report)  # all JSON
    assert [r["node_id"] for r in report["pools"]["prefill"]] == ["p0", "p1"]
    assert [r["node_id"] for r in report["pools"]["decode"]] == ["d0"]
    assert report["index"]["accuracy"] == 0.9 and report["index"]["blocks"] == 12
    assert report["index"]["freshness_s"] == {"d0": pytest.approx(1.0, abs=0.01), "p0": pytest.approx(2.0, abs=0.01)}
    assert report["router"]["running"] == 1
    assert any(e.startswith("p1: /metrics unreachable") for e in report["errors"])
    table = render(report)
    print(table)
    lines = table.splitlines()
    assert lines[0].startswith("pdserve status") and "grpc=127.0.0.1:50051" in lines[0]
    assert lines.index("prefill pool: 2 node(s)") < lines.index("decode pool: 1 node(s)")
    d0 = next(line for line in lines if line.startswith("d0 "))
    assert "50.0%" in d0 and "25.0%" in d0 and "75.0%" in d0 and "2.0 KiB" in d0 and "300ms" in d0
    assert next(line for line in lines if line.startswith("p1 ")).endswith("registry")
    assert "index: 12 block keys; entries per node: d0 5, p0 9" in table
    assert "index memory: 2.7 KiB in Redis, 200 B per (block, node) entry, 12.5 B per cached token" in table
    assert "accuracy: 0.900" in table and "recent errors:" in table
    # Without a router: accuracy unknown, and the table says how to get it.
    bare = render(build_report(nodes, scrapes, now=now, index=index))
    assert "accuracy: - (no router /metrics: --router-metrics)" in bare


def test_prometheus_targets():
    report = {"pools": {"decode": [{"node_id": "d0", "metrics": "h:2"}],
                        "prefill": [{"node_id": "p0", "metrics": "h:1"}, {"node_id": "p1", "metrics": None}]}}
    assert prometheus_targets(report, "h:8000") == [
        {"targets": ["h:8000"], "labels": {"job": "pdserve-router", "role": "router"}},
        {"targets": ["h:2"], "labels": {"job": "pdserve-nodes", "role": "decode", "node_id": "d0"}},
        {"targets": ["h:1"], "labels": {"job": "pdserve-nodes", "role": "prefill", "node_id": "p0"}},
    ]


def test_metrics_url():
    assert metrics_url("127.0.0.1:8000") == "http://127.0.0.1:8000/metrics"
    assert metrics_url("http://r:8000/") == "http://r:8000/metrics"
    assert metrics_url("http://r:8000/metrics") == "http://r:8000/metrics"


# ------------------------------------------------------------------ the command, for real
@pytest.fixture(scope="module")
def live(tiny_dir, redis_url):
    from tests.clusters import start_node
    from tests.helpers import node_engine_config

    eng = node_engine_config(tiny_dir)
    ns = f"status-{uuid.uuid4().hex[:8]}"
    kw = dict(redis_url=redis_url, namespace=ns, lease_s=2.0, heartbeat_s=0.1)
    nodes = [start_node("prefill", "p0", eng, **kw), start_node("decode", "d0", eng, **kw)]
    router = RouterMetrics(str(tiny_dir))
    router.watch_index(lambda: {"p0": 0.1}, lambda: 0.8)
    router_http = MetricsServer(router.registry, "127.0.0.1", 0)
    yield {"ns": ns, "prefill": nodes[0], "decode": nodes[1], "router": router_http.address, "url": redis_url}
    router_http.stop()
    for n in nodes:
        n.stop()


def _drive(live) -> int:
    """One disaggregated request through the pair; returns the bytes pushed."""
    from kv_transfer.grpc_transport import KV_GRPC_OPTIONS
    from protos.convert import sampling_to_proto
    from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
    from tokens.block_hash import hash_prompt_blocks
    from tokens.sampling_params import SamplingParams

    dec, pre = live["decode"], live["prefill"]
    prompt, fp = list(range(40, 73)), dec.engine.fingerprint
    params = sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    with grpc.insecure_channel(dec.address, options=KV_GRPC_OPTIONS) as dch, grpc.insecure_channel(pre.address) as pch:
        res = kv_pb2_grpc.KVTransferStub(dch).ReserveBlocks(kv_pb2.ReserveBlocksRequest(
            request_id="s1", model_fingerprint=fp, block_size=4, num_tokens=len(prompt),
            block_hashes=hash_prompt_blocks(prompt, 4, fp.encode()), prompt_token_ids=prompt), timeout=10)
        first = kv_pb2_grpc.PrefillNodeStub(pch).Prefill(kv_pb2.PrefillRequest(
            request_id="s1", prompt_token_ids=prompt, sampling=params, decode_address=dec.address,
            reservation=res), timeout=30)
        list(kv_pb2_grpc.DecodeNodeStub(dch).Decode(kv_pb2.DecodeRequest(
            request_id="s1", prompt_token_ids=prompt, sampling=params, first_token_ids=first.first_token_ids,
            cached_prompt_tokens=first.cached_tokens), timeout=30))
    return first.bytes_sent


def test_pdserve_status_json_against_live_nodes(live, capsys, tmp_path):
    from deploy.cli import main

    sent = _drive(live)
    time.sleep(0.3)  # a heartbeat and the block events reach Redis
    rc = main(["status", "--redis-url", live["url"], "--namespace", live["ns"], "--json",
               "--router-metrics", live["router"]])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads(out.strip().splitlines()[-1])
    (p0,), (d0,) = report["pools"]["prefill"], report["pools"]["decode"]
    assert p0["node_id"] == "p0" and d0["node_id"] == "d0"
    assert p0["source"] == d0["source"] == "metrics"
    assert p0["metrics"] == live["prefill"].metrics_address
    assert p0["transfer_bytes"] == d0["transfer_bytes"] == sent > 0
    assert p0["requests"]["prefilled"] == 1 and d0["requests"]["length"] == 1
    assert p0["prefix_cache_hit_ratio"] is not None and d0["running"] == 0
    assert p0["last_seen_s"] < 2.0
    idx = report["index"]
    assert idx["blocks"] > 0 and idx["blocks_complete"] and idx["entries"]["p0"] > 0
    # What the index costs: Redis's memory per (block, node) entry and per cached token.
    assert idx["redis_bytes"] > 0 and idx["bytes_per_entry"] > 0
    assert idx["bytes_per_cached_token"] == pytest.approx(idx["redis_bytes"] / (4 * sum(idx["entries"].values())),
                                                          rel=0.01)
    assert set(idx["freshness_s"]) >= {"p0"}
    assert idx["accuracy"] == 0.8
    assert report["errors"] == []
    # Prometheus service discovery from the same refresh.
    sd = tmp_path / "targets.json"
    assert main(["status", "--redis-url", live["url"], "--namespace", live["ns"], "--json",
                 "--prometheus-sd", str(sd)]) == 0
    capsys.readouterr()
    targets = json.loads(sd.read_text())
    assert {"targets": [live["prefill"].metrics_address],
            "labels": {"job": "pdserve-nodes", "role": "prefill", "node_id": "p0"}} in targets
    assert {t["labels"]["node_id"] for t in targets} == {"p0", "d0"}
    # The table form of the same data.
    assert main(["status", "--redis-url", live["url"], "--namespace", live["ns"]]) == 0
    table = capsys.readouterr().out
    assert "prefill pool: 1 node(s)" in table and "decode pool: 1 node(s)" in table
    assert "accuracy: - (no router /metrics" in table


def test_pdserve_status_unreachable_router_is_an_error_line(live, capsys):
    from deploy.cli import main

    assert main(["status", "--redis-url", live["url"], "--namespace", live["ns"], "--json",
                 "--router-metrics", "127.0.0.1:1"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["index"]["accuracy"] is None and "error" in report["router"]
    assert any(e.startswith("router: /metrics unreachable") for e in report["errors"])
