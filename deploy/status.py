"""`pdserve status`: what a running cluster is doing, from the same data as ``/metrics``.

Each figure has one source, so the terminal view, ``--json`` and a Prometheus dashboard agree:

    node registry (Redis)      which nodes are live, their pool, addresses, last heartbeat
    each node's /metrics       running, waiting, KV usage, prefix-cache hits, speculative
                               acceptance, KV transfer bytes / failures, request counts;
                               per KV tier (device, host, disk) blocks, usage, hits, bytes
                               moved and onboard time (deploy/status_tiers.py)
    the router's /metrics      index accuracy (``pdserve:index_accuracy``), when reachable
    the index keys (Redis)     index size: block keys (SCAN, capped) and entries per node
                               (SCARD of each node's block set); Redis bytes per entry and
                               per cached token (INFO memory); freshness per node
    router records (Redis)     the live router replicas, their requests in flight and the
                               prefill backlog each placed (deploy/status_routers.py)
    health records (Redis)     why a node is unhealthy, restarting or down, and its restarts
                               (kv_index/health.py): such a node has left the registry

The module has two halves. The pure half turns metrics text and registry entries into one
report dict (``parse_metrics``, ``node_row``, ``build_report``) and the report into a table
(``render``); tests feed it strings. The I/O half (``scrape``, ``index_size``, ``gather``)
reads Redis and the HTTP endpoints; ``deploy/cli.py`` wires both to the command line.
"""
from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from deploy.status_plan import render_plan
from deploy.status_pools import render_pools
from deploy.status_routers import render_routers
from deploy.status_tiers import add_tier_sample, render_tiers, tier_errors, tier_row
from kv_index.health import DOWN, SERVING, STARTING, UNHEALTHY, HealthRecord
from kv_index.nodes import NodeInfo, index_freshness

P = "pdserve:"
SCRAPE_TIMEOUT_S = 2.0
# SCAN calls (COUNT 1000 each) spent counting block keys: about a million keys examined at
# most; past that the count is a lower bound (``blocks_complete`` false).
MAX_SCAN_CALLS = 1000

# Sample name on /metrics -> figure name in the report (counters carry Prometheus' _total).
_PLAIN = {
    P + "num_requests_running": "running",
    P + "num_requests_waiting": "waiting",
    P + "kv_cache_usage_perc": "kv_usage",
    P + "num_preemptions_total": "preemptions",
    P + "prefix_cache_queries_total": "prefix_cache_queries",
    P + "prefix_cache_hits_total": "prefix_cache_hits",
    P + "spec_decode_num_drafts_total": "spec_drafts",
    P + "spec_decode_num_draft_tokens_total": "spec_draft_tokens",
    P + "spec_decode_num_accepted_tokens_total": "spec_accepted_tokens",
    P + "prompt_tokens_total": "prompt_tokens",
    P + "generation_tokens_total": "generation_tokens",
    P + "kv_transfer_bytes_total": "transfer_bytes",
    P + "kv_transfer_failures_total": "transfer_failures",
    P + "kv_transfer_seconds_count": "transfers",
    P + "kv_transfer_seconds_sum": "transfer_seconds",
    P + "index_accuracy": "index_accuracy",
}
# Histograms whose mean the report shows: sample prefix -> figure name.
_MEANS = {
    P + "time_to_first_token_seconds": "ttft",
    P + "inter_token_latency_seconds": "itl",
    P + "e2e_request_latency_seconds": "e2e",
    P + "request_queue_time_seconds": "queue",
}
# Label -> figure: counters and gauges reported per label value.
_BY_LABEL = {
    P + "request_success_total": ("finished_reason", "requests"),
    P + "index_freshness_seconds": ("node_id", "index_freshness_s"),
    P + "requests_rejected_total": ("reason", "rejected"),
}


# ---------------------------------------------------------------------------------- pure half
def prometheus_targets(report: Mapping, router_http: str | None = None) -> list[dict]:
    """Prometheus file-based service discovery (``file_sd_configs``) for the report's cluster:
    the router's HTTP port and every node's metrics address, each with its role and node id as
    labels. Node ports are picked at start (a free port each), so a static scrape config would
    go stale after a restart; ``pdserve status --watch --prometheus-sd FILE`` keeps it current."""
    out = []
    if router_http:
        out.append({"targets": [router_http], "labels": {"job": "pdserve-router", "role": "router"}})
    for role, rows in sorted(report.get("pools", {}).items()):
        for row in rows:
            if row.get("metrics"):
                out.append({"targets": [row["metrics"]],
                            "labels": {"job": "pdserve-nodes", "role": role, "node_id": row["node_id"]}})
    return out


def parse_metrics(text: str) -> dict:
    """Prometheus text of one process -> its figures, summed over label sets: the names in
    ``_PLAIN``, ``{ttft,itl,e2e,queue}_{sum,count}``, and dicts per label value
    (``requests`` by finished reason, ``index_freshness_s`` by node, ``rejected`` by reason).
    A metric the text does not have is absent (e.g. ``index_accuracy`` before any prefill)."""
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in _PLAIN:
                key = _PLAIN[s.name]
                out[key] = out.get(key, 0.0) + s.value
            elif add_tier_sample(out, s):
                pass  # per-tier KV cache figures (deploy/status_tiers.py)
            elif s.name in _BY_LABEL:
                label, key = _BY_LABEL[s.name]
                d = out.setdefault(key, {})
                v = s.labels.get(label, "")
                d[v] = d.get(v, 0.0) + s.value
            else:
                for prefix, key in _MEANS.items():
                    if s.name in (prefix + "_sum", prefix + "_count"):
                        k = f"{key}_{s.name.rsplit('_', 1)[1]}"
                        out[k] = out.get(k, 0.0) + s.value
    return out


def _ratio(num, den) -> float | None:
    return num / den if num is not None and den else None


def _mean(m: Mapping, key: str) -> float | None:
    return _ratio(m.get(f"{key}_sum"), m.get(f"{key}_count"))


@dataclass(frozen=True)
class Sample:
    """One scrape of one node: when, and what it said (``parse_metrics``); the previous one
    turns counters into rates in ``--watch``."""

    at: float
    figures: dict = field(default_factory=dict)


def node_row(info: NodeInfo, now: float, scraped: Sample | None, prev: Sample | None = None,
             error: str | None = None) -> dict:
    """One node's line of the report. With a scrape, every figure comes from the node's /metrics;
    without one (``error`` says why) running / waiting / KV usage fall back to its last heartbeat
    in the registry and ``source`` says so. Ratios are since the node started; the transfer rate
    needs ``prev``, an earlier scrape of the same node (else None, and the byte total stands)."""
    row = {"node_id": info.node_id, "role": str(info.role), "grpc": info.grpc_address,
           "metrics": info.metrics_address or None,
           "last_seen_s": round(max(0.0, now - info.updated_at), 3) if info.updated_at else None}
    if scraped is None:
        row.update(source="registry", error=error, running=info.running, waiting=info.waiting,
                   kv_usage=info.kv_usage)
        return row
    m = scraped.figures
    requests = m.get("requests", {})
    row.update(
        source="metrics",
        running=int(m.get("running", 0)), waiting=int(m.get("waiting", 0)), kv_usage=m.get("kv_usage", 0.0),
        prefix_cache_hit_ratio=_ratio(m.get("prefix_cache_hits"), m.get("prefix_cache_queries")),
        spec_acceptance=_ratio(m.get("spec_accepted_tokens"), m.get("spec_draft_tokens")),
        preemptions=int(m.get("preemptions", 0)),
        transfer_bytes=int(m.get("transfer_bytes", 0)), transfers=int(m.get("transfers", 0)),
        transfer_failures=int(m.get("transfer_failures", 0)),
        transfer_mb_s=None,
        requests={k: int(v) for k, v in sorted(requests.items())},
        prompt_tokens=int(m.get("prompt_tokens", 0)), generation_tokens=int(m.get("generation_tokens", 0)),
        mean_ttft_s=_mean(m, "ttft"), mean_itl_s=_mean(m, "itl"), mean_e2e_s=_mean(m, "e2e"),
        mean_queue_s=_mean(m, "queue"), tiers=tier_row(m),
    )
    if prev is not None and scraped.at > prev.at:
        dt = scraped.at - prev.at
        row["transfer_mb_s"] = max(0.0, m.get("transfer_bytes", 0) - prev.figures.get("transfer_bytes", 0)) / dt / 1e6
        row["new_transfer_failures"] = int(max(0, m.get("transfer_failures", 0)
                                               - prev.figures.get("transfer_failures", 0)))
        row["new_aborts"] = int(max(0, requests.get("abort", 0) - prev.figures.get("requests", {}).get("abort", 0)))
    return row


def recent_errors(rows: list[dict]) -> list[str]:
    """What went wrong, one line each: unreachable /metrics, KV transfer failures and aborts
    (new since the previous refresh in --watch, else the totals)."""
    out = []
    for r in rows:
        nid = r["node_id"]
        if r["source"] != "metrics":
            out.append(f"{nid}: /metrics unreachable ({r.get('error') or 'no metrics address'}); "
                       f"load from its last heartbeat")
            continue
        new = r.get("new_transfer_failures")
        if new:
            out.append(f"{nid}: {new} new KV transfer failure(s) ({r['transfer_failures']} in all)")
        elif new is None and r["transfer_failures"]:
            out.append(f"{nid}: {r['transfer_failures']} KV transfer failure(s) since start")
        out.extend(tier_errors(r))
        aborts = r.get("new_aborts")
        if aborts:
            out.append(f"{nid}: {aborts} new aborted request(s)")
        elif aborts is None and r["requests"].get("abort"):
            out.append(f"{nid}: {r['requests']['abort']} aborted request(s) since start")
    return out


def health_rows(records: Mapping[str, HealthRecord], live: Iterable[str], now: float) -> list[dict]:
    """The health records worth a line: a node down, unhealthy (restarting), starting again
    after a failure, or serving after restarts; a first start and a clean record say nothing."""
    live = set(live)
    rows = []
    for nid, rec in sorted(records.items()):
        if (rec.state == SERVING and not rec.restarts) or (rec.state == STARTING and rec.failures <= 1):
            continue
        rows.append({"node_id": nid, "state": rec.state, "reason": rec.reason, "failures": rec.failures,
                     "restarts": rec.restarts, "age_s": round(max(0.0, now - rec.at), 3) if rec.at else None,
                     "live": nid in live})
    return rows


def health_errors(rows: list[dict]) -> list[str]:
    out = []
    for h in rows:
        nid, why = h["node_id"], h["reason"] or "no reason recorded"
        if h["state"] == DOWN:
            out.append(f"{nid}: down after {h['failures']} failed start(s) in a row, not restarted: {why}")
        elif h["state"] == UNHEALTHY:
            out.append(f"{nid}: unhealthy, left the index, restarting: {why}")
        elif h["state"] == STARTING:
            out.append(f"{nid}: starting again (try {h['failures']}) after: {why}")
    return out


def build_report(nodes: Mapping[str, NodeInfo], scrapes: Mapping[str, Sample | str], *, now: float,
                 prev: Mapping[str, Sample] | None = None, index: Mapping | None = None,
                 router: Sample | str | None = None, cluster: Mapping | None = None,
                 health: Mapping[str, HealthRecord] | None = None) -> dict:
    """The whole view as one JSON-able dict. ``scrapes``: node id -> its Sample, or why there
    is none; ``index``: from ``index_size``; ``router``: the router's Sample, why it failed, or
    None when no router address is known; ``health``: the nodes' health records; ``now``: wall
    clock (the registry's times are)."""
    prev = prev or {}
    rows = []
    for nid, info in sorted(nodes.items(), key=lambda kv: (str(kv[1].role), kv[0])):
        got = scrapes.get(nid)
        if isinstance(got, Sample):
            rows.append(node_row(info, now, got, prev.get(nid)))
        else:
            rows.append(node_row(info, now, None, error=got))
    pools: dict[str, list[dict]] = {}
    for r in rows:
        pools.setdefault(r["role"], []).append(r)
    rf = router.figures if isinstance(router, Sample) else {}
    idx = dict(index or {})
    idx["freshness_s"] = {k: round(v, 3) for k, v in index_freshness(nodes.values(), now).items()}
    idx["accuracy"] = rf.get("index_accuracy")
    router_part = None
    if router is not None:
        router_part = ({"error": router} if not isinstance(router, Sample) else
                       {"running": int(rf.get("running", 0)), "requests": {k: int(v) for k, v in
                                                                          rf.get("requests", {}).items()},
                        "rejected": {k: int(v) for k, v in rf.get("rejected", {}).items()},
                        "mean_ttft_s": _mean(rf, "ttft"), "mean_e2e_s": _mean(rf, "e2e")})
    hrows = health_rows(health or {}, nodes, now)
    errors = health_errors(hrows) + recent_errors(rows)
    if isinstance(router, str):
        errors.append(f"router: /metrics unreachable ({router}); no index accuracy")
    return {"time": now, "cluster": dict(cluster or {}), "pools": pools, "health": hrows, "index": idx,
            "router": router_part, "errors": errors}


def mark_switching(report: Mapping, desired: Mapping[str, str]) -> None:
    """Each node row gets ``desired_role`` (kv_index/roles.py; None: no wish) and ``switching``:
    a role is wished that differs from the one it serves (it switches at its next heartbeat)."""
    for rows in report["pools"].values():
        for row in rows:
            want = desired.get(row["node_id"])
            row["desired_role"] = str(want) if want is not None else None
            row["switching"] = want is not None and str(want) != row["role"]


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _age(s) -> str:
    return "-" if s is None else f"{s:.1f}s"


COLUMNS = (("node", 12, "<"), ("running", 7, ">"), ("waiting", 7, ">"), ("kv use", 7, ">"),
           ("prefix hit", 10, ">"), ("spec acc", 8, ">"), ("KV transfer", 14, ">"), ("fails", 5, ">"),
           ("done", 5, ">"), ("ttft", 7, ">"), ("seen", 6, ">"), ("src", 8, "<"))


def _line(cells) -> str:
    return " ".join(f"{c:{align}{width}}" for c, (_, width, align) in zip(cells, COLUMNS)).rstrip()


def render(report: Mapping) -> str:
    """The report as the terminal table: one block per pool, then the index and errors."""
    c = report.get("cluster") or {}
    head = "pdserve status  " + time.strftime("%H:%M:%S", time.localtime(report["time"]))
    for key in ("grpc", "http", "redis_url", "namespace"):
        if c.get(key):
            head += f"  {key}={c[key]}"
    lines = [head]
    if not report["pools"]:
        lines.append("no live nodes")
    for role in sorted(report["pools"], key=lambda r: (r != "prefill", r)):
        rows = report["pools"][role]
        lines += ["", f"{role} pool: {len(rows)} node(s)", _line(name for name, _, _ in COLUMNS)]
        for r in rows:
            if r["source"] == "metrics":
                xfer = (f"{r['transfer_mb_s']:.2f} MB/s" if r.get("transfer_mb_s") is not None
                        else _bytes(r["transfer_bytes"]))
                ttft = "-" if r["mean_ttft_s"] is None else f"{r['mean_ttft_s'] * 1e3:.0f}ms"
                cells = (r["node_id"], r["running"], r["waiting"], _pct(r["kv_usage"]),
                         _pct(r["prefix_cache_hit_ratio"]), _pct(r["spec_acceptance"]), xfer,
                         r["transfer_failures"], sum(r["requests"].values()), ttft, _age(r["last_seen_s"]), "metrics")
            else:
                cells = (r["node_id"], r["running"], r["waiting"], _pct(r["kv_usage"]), "-", "-", "-", "-", "-",
                         "-", _age(r["last_seen_s"]), "registry")
            lines.append(_line(cells))
            if r.get("switching"):  # mark_switching
                lines.append(f"  switching {r['role']} -> {r['desired_role']} (a refused switch stays listed: "
                             "see the node's log, pdserve:role_switches_total)")
            tiers = render_tiers(r, _bytes)
            if tiers:
                lines.append(tiers)
    if report.get("health"):
        lines += ["", "node health:"]
        for h in report["health"]:
            lines.append(f"  {h['node_id']:<12} {h['state']:<9} failures {h['failures']}, restarts {h['restarts']}, "
                         f"{_age(h['age_s'])} ago: {h['reason'] or '-'}")
    idx = report["index"]
    lines.append("")
    if "blocks" in idx:
        more = "" if idx.get("blocks_complete", True) else "+ (scan capped)"
        entries = ", ".join(f"{k} {v}" for k, v in sorted(idx.get("entries", {}).items()))
        lines.append(f"index: {idx['blocks']}{more} block keys; entries per node: {entries or '-'}")
        if idx.get("bytes_per_cached_token") is not None:
            lines.append(f"index memory: {_bytes(idx['redis_bytes'])} in Redis, {idx['bytes_per_entry']:.0f} B per "
                         f"(block, node) entry, {idx['bytes_per_cached_token']:.1f} B per cached token")
    fresh = ", ".join(f"{k} {_age(v)}" for k, v in sorted(idx["freshness_s"].items()))
    acc = "-" if idx.get("accuracy") is None else f"{idx['accuracy']:.3f}"
    lines.append(f"index freshness: {fresh or '-'}; accuracy: {acc}"
                 + ("" if report.get("router") is not None else " (no router /metrics: --router-metrics)"))
    lines += render_routers(report.get("routers"))  # deploy/status_routers.py
    lines += render_pools(report.get("pool_sizes"))  # deploy/status_pools.py
    lines += render_plan(report.get("plan"))  # deploy/status_plan.py
    if report["errors"]:
        lines += ["", "recent errors:"] + [f"  {e}" for e in report["errors"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- I/O half
def metrics_url(address: str) -> str:
    """"host:port" or a URL -> the URL of its /metrics."""
    url = address if "://" in address else f"http://{address}"
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def scrape(address: str, timeout: float = SCRAPE_TIMEOUT_S) -> Sample | str:
    """GET /metrics -> a Sample, or why not (a string)."""
    try:
        with urllib.request.urlopen(metrics_url(address), timeout=timeout) as resp:
            text = resp.read().decode()
        return Sample(time.monotonic(), parse_metrics(text))
    except Exception as e:  # unreachable, refused, not Prometheus text: shown, not raised
        return f"{type(e).__name__}: {e}"


def index_size(r, ns: str, node_ids, max_scan_calls: int = MAX_SCAN_CALLS) -> dict:
    """Blocks indexed (the fields of the ``{ns}:b:*`` buckets, HLEN each, one pipelined round
    trip), each node's entries (its registry ``held`` count, O(1)) and what they cost: Redis's
    memory beyond its empty state per entry and per cached token (``node_ids`` a mapping to
    ``NodeInfo``: each node's entries count its block size in tokens). The index is nearly all
    of that memory; the registry and step streams are a few KiB per node, other namespaces on
    the same Redis count too. ``max_scan_calls``: kept for callers; the bucket count is fixed."""
    from kv_index.schema import BUCKETS, bucket_key, node_entries, nodes_key

    ids = sorted(node_ids)
    entries = node_entries(r, ns, ids)
    p = r.pipeline(transaction=False)
    for b in range(BUCKETS):
        p.hlen(bucket_key(ns, b))
    blocks = sum(int(n) for n in p.execute())
    if hasattr(r, "get_node_from_key"):  # Redis Cluster: the master of the index's slot (one hash tag)
        mem = r.info("memory", target_nodes=r.get_node_from_key(nodes_key(ns)))
    else:
        mem = r.info("memory")
    used = max(0, int(mem.get("used_memory", 0)) - int(mem.get("used_memory_startup", 0)))
    sizes = {nid: getattr(node_ids[nid], "block_size", 0) for nid in ids} if isinstance(node_ids, Mapping) else {}
    tokens = sum(n * sizes.get(nid, 0) for nid, n in entries.items())
    cost = {"redis_bytes": used,
            "bytes_per_entry": round(used / sum(entries.values()), 1) if sum(entries.values()) else None,
            "bytes_per_cached_token": round(used / tokens, 2) if tokens else None}
    return {"blocks": blocks, "blocks_complete": True, "entries": entries, **cost}


def gather(r, ns: str, *, router_metrics: str | None = None, prev: Mapping[str, Sample] | None = None,
           cluster: Mapping | None = None) -> tuple[dict, dict[str, Sample]]:
    """One refresh: registry, every node's /metrics (in parallel), the index, the router.
    Returns the report and this round's samples (the next round's ``prev``)."""
    from deploy.status_plan import plan_section
    from deploy.status_pools import pool_section
    from deploy.status_routers import router_section
    from kv_index.health import HealthStore
    from kv_index.plan import PlanStore
    from kv_index.pool_targets import PoolTargets
    from kv_index.reader import IndexReader
    from kv_index.roles import RoleStore

    nodes = IndexReader(r, ns).live_nodes()
    health = HealthStore(r, ns).read_all()
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(nodes) + 1))) as pool:
        futures = {nid: pool.submit(scrape, n.metrics_address) for nid, n in nodes.items() if n.metrics_address}
        router_f = pool.submit(scrape, router_metrics) if router_metrics else None
        scrapes: dict[str, Sample | str] = {nid: "no metrics address registered" for nid in nodes}
        scrapes.update({nid: f.result() for nid, f in futures.items()})
        router = router_f.result() if router_f is not None else None
    report = build_report(nodes, scrapes, now=time.time(), prev=prev, index=index_size(r, ns, nodes),
                          router=router, cluster=cluster, health=health)
    report["routers"] = router_section(r, ns, report["time"])
    report["pool_sizes"] = pool_section(PoolTargets(r, ns), nodes, report["time"])
    report["plan"] = plan_section(PlanStore(r, ns), report["time"])
    mark_switching(report, RoleStore(r, ns).all())
    return report, {nid: s for nid, s in scrapes.items() if isinstance(s, Sample)}
