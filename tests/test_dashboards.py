"""The shipped Grafana dashboard and Prometheus config refer only to metrics that exist."""
from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest

from telemetry.metrics import NodeMetrics, RouterMetrics

REPO = Path(__file__).resolve().parent.parent
STATS = {"running": 1, "waiting": 0, "kv_usage": 0.1, "preemptions": 0, "prefix_cache_query_tokens": 1,
         "prefix_cache_hit_tokens": 1, "speculative": {"drafts": 1, "draft_tokens": 2, "accepted_tokens": 1}}


def exported_names() -> set[str]:
    router = RouterMetrics("m")
    router.watch_index(lambda: {"n": 1.0}, lambda: 1.0)
    node = NodeMetrics("m", "decode", "d0", engine_stats=lambda: STATS)
    names = set()
    for reg in (router.registry, node.registry):
        for line in generate_latest(reg).decode().splitlines():
            if line and not line.startswith("#"):
                names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_every_dashboard_query_names_an_exported_metric():
    dash = json.loads((REPO / "deploy/grafana/pdserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"pdserve:[a-z0-9_]+", e)}
    assert used, "no queries found"
    missing = used - exported_names()
    assert not missing, f"the dashboard queries metrics nobody exports: {sorted(missing)}"
    assert {p["gridPos"]["y"] for p in dash["panels"]}, "panels are placed"


def test_prometheus_config_reads_the_status_targets_file():
    text = (REPO / "deploy/grafana/prometheus.yml").read_text()
    assert "file_sd_configs" in text and "--prometheus-sd" in text
