"""One planner per cluster, on a real Redis: the leader lease (kv_index/plan.py), a follower
taking over when the leader stops renewing or Redis hangs (a real redis-server frozen with
SIGSTOP, resumed in ``finally``), and advisory mode changing nothing in the real role and
pool-target stores (read back from Redis)."""
from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path

import pytest

from deploy.redis_server import RedisServer
from kv_index.client import RedisTimeouts, redis_client
from kv_index.nodes import Role
from kv_index.plan import PlanStore
from kv_index.pool_targets import PoolTargets
from kv_index.roles import RoleStore
from router.planner.config import PlannerConfig, add_planner_arguments, planner_config
from router.planner.loop import PlannerLoop
from tests.test_planner import signals

FAST = dict(interval_s=0.1, leader_lease_s=0.3, confirm_rounds=1, cooldown_s=0.0)


class Policy:
    """What the loop sets the live threshold on (the router's placement policy)."""

    def __init__(self) -> None:
        self.short_prompt_tokens = 256

    def apply(self, tokens: int) -> None:
        self.short_prompt_tokens = tokens


def planner(client, ns: str, cfg: PlannerConfig, name: str, policy: Policy, long_share: float = 0.1,
            decisions: list | None = None) -> PlannerLoop:
    # Chat-heavy load on 1P+1D: the planner wants two colocated nodes.
    return PlannerLoop(cfg, PlanStore(client, ns), RoleStore(client, ns), PoolTargets(client, ns),
                       lambda: signals(long_share, 1.0, threshold=policy.short_prompt_tokens, at=time.time()),
                       policy.apply, name, on_decision=lambda a, r: decisions.append((a, r)) if decisions is not None
                       else None)


def test_one_leads_the_other_follows_and_takes_over_when_the_lease_lapses(redis_url):
    ns = f"plan-{uuid.uuid4().hex[:6]}"
    client = redis_client(redis_url, RedisTimeouts(0.5, 0.5))
    cfg = PlannerConfig(mode="active", **FAST)
    pa, pb = Policy(), Policy()
    decisions: list = []
    a = planner(client, ns, cfg, "router-a", pa, decisions=decisions)
    b = planner(client, ns, cfg, "router-b", pb)
    d = a.round()
    assert d is not None and d.action == "switch_roles" and decisions == [("switch_roles", "decode_bound")]
    assert b.round() is None and not b.leading  # a holds the lease
    plans = PlanStore(client, ns)
    plan = plans.read()
    assert plan["leader"] == "router-a" and plan["applied"] is True and plan["action"] == "switch_roles"
    assert plan["layout"] == {"prefill": 0, "decode": 2} and plan["roles"] == {"node-0": "decode"}
    assert RoleStore(client, ns).all() == {"node-0": Role.DECODE}
    assert plans.leader().holder == "router-a"
    # The leader renews; nobody else can.
    assert a.round() is not None and plans.leader().holder == "router-a"
    assert not plans.release("router-b") and plans.leader().holder == "router-a"
    # a stops renewing (a router that hangs or dies): b takes over once the lease lapses.
    time.sleep(cfg.leader_lease_s + 0.1)
    assert b.round() is not None and b.leading
    assert plans.leader().holder == "router-b" and plans.read()["leader"] == "router-b"
    assert a.round() is None and not a.leading


def test_a_follower_applies_the_leaders_threshold(redis_url):
    ns = f"plan-{uuid.uuid4().hex[:6]}"
    client = redis_client(redis_url, RedisTimeouts(0.5, 0.5))
    plans = PlanStore(client, ns)
    pb = Policy()
    b = planner(client, ns, PlannerConfig(mode="active", **FAST), "router-b", pb)
    assert plans.lead("router-a", 5.0)
    plans.publish({"leader": "router-a", "applied": False, "threshold": 64})
    b.round()
    assert pb.short_prompt_tokens == 256  # advisory plans change nothing
    plans.publish({"leader": "router-a", "applied": True, "threshold": 64})
    b.round()
    assert pb.short_prompt_tokens == 64 and not b.leading


def test_advisory_reports_and_never_acts(redis_url):
    ns = f"plan-{uuid.uuid4().hex[:6]}"
    client = redis_client(redis_url, RedisTimeouts(0.5, 0.5))
    # Resizing allowed too, so the decision would set pool targets as well as roles.
    cfg = PlannerConfig(mode="advisory", max_prefill_nodes=2, max_decode_nodes=3, resize=True, **FAST)
    pol = Policy()
    p = planner(client, ns, cfg, "router-a", pol)
    d = p.round()
    assert d is not None and d.acts and (d.roles or d.pool_targets)
    plan = PlanStore(client, ns).read()
    assert plan["applied"] is False and plan["mode"] == "advisory" and plan["action"] == d.action
    assert plan["figures"]["rate_rps"] > 0 and plan["detail"]
    assert RoleStore(client, ns).all() == {}
    assert PoolTargets(client, ns).get() == {}
    assert pol.short_prompt_tokens == 256


def test_a_hung_redis_makes_the_planner_stand_still_then_another_takes_over():
    with RedisServer() as server:
        ns = f"plan-{uuid.uuid4().hex[:6]}"
        client_a = redis_client(server.url, RedisTimeouts(0.3, 0.3))
        client_b = redis_client(server.url, RedisTimeouts(0.3, 0.3))
        cfg = PlannerConfig(mode="active", **FAST)
        a = planner(client_a, ns, cfg, "router-a", Policy())
        b = planner(client_b, ns, cfg, "router-b", Policy())
        assert a.round() is not None
        with server.frozen():
            t0 = time.monotonic()
            assert a.round() is None  # the lease call timed out: this round does nothing
            assert b.round() is None
            assert time.monotonic() - t0 < 3.0  # bounded by the clients' reply timeouts
            time.sleep(cfg.leader_lease_s)  # the lease runs out meanwhile (Redis expires it on waking)
        # Redis wakes and runs the commands queued meanwhile (a timed-out lease call may still
        # take the lapsed lease: kv_index/client.py). Whoever holds it, one planner leads.
        plans = PlanStore(client_b, ns)
        a.round(), b.round()
        assert a.leading != b.leading
        assert plans.leader().holder == ("router-a" if a.leading else "router-b")
        # The leader then stops (hung router, dead process): the other takes over.
        other = b if a.leading else a
        time.sleep(cfg.leader_lease_s + 0.1)
        assert other.round() is not None and other.leading
        assert plans.leader().holder == other.holder


def test_the_flags_map_onto_the_config():
    p = argparse.ArgumentParser()
    add_planner_arguments(p)
    cfg = planner_config(p.parse_args(["--planner", "active", "--planner-interval-s", "2", "--planner-cooldown-s",
                                       "10", "--min-prefill-nodes", "1", "--max-prefill-nodes", "2",
                                       "--max-decode-nodes", "4", "--planner-resize", "--planner-window-s", "15",
                                       "--planner-slo-band", "0.5,1,2", "--planner-burst-window-s", "5"]))
    assert (cfg.mode, cfg.interval_s, cfg.cooldown_s, cfg.burst_window_s) == ("active", 2.0, 10.0, 5.0)
    assert (cfg.min_prefill_nodes, cfg.max_prefill_nodes, cfg.min_decode_nodes, cfg.max_decode_nodes) == (1, 2, 1, 4)
    assert cfg.resize and cfg.window_s == 15.0 and cfg.slo_band == (0.5, 1.0, 2.0)
    assert planner_config(p.parse_args([])) == PlannerConfig()  # the flags' defaults are the config's
    with pytest.raises(ValueError, match="above max_decode_nodes"):
        planner_config(p.parse_args(["--min-decode-nodes", "3", "--max-decode-nodes", "2"]))
    with pytest.raises(ValueError, match="slo_band must be one or more finite numbers > 0"):
        planner_config(p.parse_args(["--planner-slo-band", "1,-1"]))
    with pytest.raises(ValueError, match="burst_window_s must be a finite number >= 0"):
        planner_config(p.parse_args(["--planner-burst-window-s", "-1"]))


def test_pdserve_up_flags_reach_the_routers_planner():
    from deploy.cli import add_up_arguments, cluster_config_from_args
    from deploy.launcher import router_config

    p = argparse.ArgumentParser()
    add_up_arguments(p)
    bring_up = dict(redis_url="redis://127.0.0.1:1/0", model_name="m", tokenizer_dir="/nonexistent", max_model_len=64)
    rc = router_config(cluster_config_from_args(p.parse_args(["--planner", "active", "--planner-cooldown-s", "12",
                                                              "--planner-window-s", "20", "--planner-slo-band", "0.8,1",
                                                              "--planner-burst-window-s", "0",
                                                              "--max-prefill-nodes", "1", "--max-decode-nodes", "2",
                                                              "--planner-resize"])),
                       **bring_up)
    assert (rc.planner.mode, rc.planner.cooldown_s, rc.planner.max_prefill_nodes, rc.planner.max_decode_nodes) == \
        ("active", 12.0, 1, 2) and rc.planner.resizes and rc.planner.window_s == 20.0
    assert rc.planner.slo_band == (0.8, 1.0) and rc.planner.burst_window_s == 0.0
    assert router_config(cluster_config_from_args(p.parse_args([])), **bring_up).planner.mode == "advisory"
    with pytest.raises(ValueError, match=r"prefill_nodes \(1\) is above max_prefill_nodes \(0\)"):
        cluster_config_from_args(p.parse_args(["--max-prefill-nodes", "0", "--max-decode-nodes", "2"]))
    with pytest.raises(ValueError, match="decode nodes are the only ones that decode"):
        cluster_config_from_args(p.parse_args(["--min-decode-nodes", "0"]))


def test_the_charts_planner_values_reach_the_router():
    pytest.importorskip("helm_python")
    from frontend.server import build_parser
    from tests.test_helm_chart import one, render

    def planner_of(values: dict) -> PlannerConfig:
        args = one(render(values), "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]["args"]
        return planner_config(build_parser().parse_args(args))

    p = planner_of({})
    assert (p.mode, p.interval_s, p.cooldown_s, p.min_prefill_nodes, p.min_decode_nodes) == ("advisory", 5, 30, 0, 1)
    assert p.slo_band == (1.0,)
    assert not p.resizes  # no pool targets unless the pools follow them
    p = planner_of({"router": {"planner": {"mode": "active", "intervalSeconds": 2, "cooldownSeconds": 60,
                                           "windowSeconds": 20, "burstWindowSeconds": 6, "sloBand": [0.67, 1, 1.33]}},
                    "pools": {"followTargets": True}, "prefill": {"maxReplicas": 3}, "decode": {"minReplicas": 2,
                                                                                               "maxReplicas": 4}})
    assert (p.mode, p.interval_s, p.cooldown_s, p.window_s, p.slo_band) == ("active", 2, 60, 20, (0.67, 1.0, 1.33))
    assert p.burst_window_s == 6
    assert (p.min_prefill_nodes, p.max_prefill_nodes, p.min_decode_nodes, p.max_decode_nodes) == (0, 3, 2, 4)
    assert p.resizes


def test_pdserve_status_shows_the_plan_and_its_leader(redis_url):
    from deploy.status import gather, render

    ns = f"plan-{uuid.uuid4().hex[:6]}"
    client = redis_client(redis_url, RedisTimeouts(0.5, 0.5))
    report, _ = gather(client, ns)
    assert report["plan"] is None and "planner:" not in render(report)  # no planner ever ran
    p = planner(client, ns, PlannerConfig(mode="advisory", **FAST), "router-a", Policy())
    d = p.round()
    report, _ = gather(client, ns)
    assert report["plan"]["leader"] == "router-a" and report["plan"]["action"] == d.action
    text = render(report)
    assert "planner: advisory, led by router-a" in text
    assert f"plan (0s ago): {d.action} ({d.reason}), not applied (advisory); layout 0 prefill + 2 decode" in text
    assert "why: 1P+1D" in text and "figures: rate_rps" in text


def test_a_live_router_plans_from_what_it_serves(redis_url, tok_dir, tiny_model):
    """A real router over real prefill and decode nodes (tiny model): its planner thread leads,
    reads the requests the router served, and publishes an advisory plan; the metric counts it."""
    import json
    import urllib.request

    import pdserve
    from tests.clusters import start_node, start_router
    from tests.helpers import engine_config, prompt, wait_for

    ns = f"plan-{uuid.uuid4().hex[:6]}"
    eng = engine_config(tiny_model, num_blocks=128)
    nodes = [start_node(role, f"{role}-0", eng, redis_url=redis_url, namespace=ns, lease_s=1.5, heartbeat_s=0.2)
             for role in ("prefill", "decode")]
    cfg = PlannerConfig(interval_s=0.2, leader_lease_s=1.0, min_requests=3, confirm_rounds=1)
    router = start_router(redis_url, tok_dir, namespace=ns, max_model_len=256, http_port=0, short_prompt_tokens=32,
                          vocab_size=512, planner=cfg)
    try:
        plans = PlanStore(redis_client(redis_url), ns)
        with pdserve.Client(router.address, timeout=60) as c:
            assert wait_for(c.health, timeout=10, every=0.1)
            for i in range(4):
                c.complete(token_ids=prompt(i, 80 if i % 2 else 16), max_tokens=4, ignore_eos=True)
        assert wait_for(lambda: (plans.read() or {}).get("figures", {}).get("requests", 0) >= 4, timeout=10)
        plan = plans.read()
        assert plan["mode"] == "advisory" and plan["applied"] is False and plan["leader"].startswith("router@")
        assert plan["reason"] != "warming_up" and 0 < plan["figures"]["long_share"] < 1
        assert RoleStore(redis_client(redis_url), ns).all() == {}  # advisory: no node was asked to switch
        # A request the router placed and has not finished is in the planner's window (its
        # max_tokens as the output to come, its TTFT once its first token came: a request past
        # its target is a miss before it finishes), and leaves it when it ends, whatever the end.
        window = router.orchestrator.window
        with pdserve.Client(router.address, timeout=60) as c:
            stream = c.generate(token_ids=prompt(9, 16), max_tokens=240, ignore_eos=True, request_id="inflight-1")
            next(iter(stream))  # its first chunk: placed, running
            flying = [r for r in window.recent(time.time(), 60.0, 1) if not r.done]
            assert [(r.prompt_tokens, r.output_tokens, r.first_token_watched) for r in flying] == [(16, 240, True)]
            assert 0 < flying[0].ttft_s < 60 and flying[0].tpot_s is None
            c.abort("inflight-1")
            for _ in stream:
                pass
        assert wait_for(lambda: all(r.done for r in window.recent(time.time(), 60.0, 1)), timeout=10)
        with urllib.request.urlopen(f"http://{router.http_address}/metrics", timeout=10) as r:
            text = r.read().decode()
        series = f'action="{plan["action"]}",model_name="m",reason="{plan["reason"]}"'
        assert f"pdserve:planner_decisions_total{{{series}}}" in text, json.dumps(plan)
    finally:
        router.stop()
        for n in nodes:
            n.stop()
    assert plans.leader() is None  # the stopped router gave its lease up


def test_each_decision_is_a_span_and_a_log_line(redis_url):
    """In a process of its own: tracing, once on, stays on for the process."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import logging, sys, uuid
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from telemetry import tracing
        from kv_index.client import redis_client
        from router.planner.config import PlannerConfig
        from tests.test_planner_leader import FAST, Policy, planner

        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
        mem = InMemorySpanExporter()
        tracing.setup_tracing("t", exporter=mem)
        p = planner(redis_client(sys.argv[1]), f"plan-{uuid.uuid4().hex[:6]}", PlannerConfig(mode="advisory", **FAST),
                    "router-a", Policy())
        d = p.round()
        (span,) = mem.get_finished_spans()
        a = span.attributes
        assert span.name == "planner.decide", span.name
        assert (a["planner.action"], a["planner.reason"], a["planner.applied"]) == (d.action, d.reason, False), a
        assert a["planner.rate_rps"] > 0 and a["planner.detail"] == d.detail
        print("SPAN OK")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code, redis_url], cwd=str(Path(__file__).parents[1]),
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "SPAN OK" in out.stdout, out.stdout + out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("router.planner.loop planner switch_roles"))
    assert "(advisory: not applied) (decode_bound)" in line and "rate_rps=" in line and "target_goodput_rps=" in line
