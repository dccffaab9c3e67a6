"""Router replicas sharing one cluster (router/replicas.py) on a real redis-server: each publishes
its own in-flight prefill load, reads the others' into its ledger, a killed one's record lapses;
placement on two replicas' merged ledgers does not pile onto the node the other just filled;
`pdserve status` lists the replicas; `pdserve up --routers N` refuses what it cannot run; two
real sockets share a port with SO_REUSEPORT and not without it."""
from __future__ import annotations

import socket
import time
import uuid

import pytest

from kv_index.client import redis_client
from kv_index.nodes import NodeInfo, Role
from router.cost_model import CostBook
from router.node_view import PrefillLedger
from router.placement import PlacementRequest, TtftPolicy
from router.replicas import LoadShare, load_key, merge_others, read_replicas, replicas_key


@pytest.fixture
def r(redis_url):
    client = redis_client(redis_url)
    yield client
    client.close()


def _share(r, ns, rid, ledger=None, ttl_s=None):
    return LoadShare(r, ns, rid, ledger if ledger is not None else PrefillLedger(), every_s=0.1,
                     address=f"127.0.0.1:{rid}", inflight=lambda: 3, ttl_s=ttl_s)


def test_each_replica_sees_the_others_load_and_not_its_own_twice(r):
    ns = f"rep-{uuid.uuid4().hex[:6]}"
    la, lb = PrefillLedger(), PrefillLedger()
    a, b = _share(r, ns, "a", la), _share(r, ns, "b", lb)
    la.add("prefill-0", "r1", 2.0)
    lb.add("prefill-0", "r2", 0.5)
    lb.add("prefill-1", "r3", 1.0)
    for s in (a, b):
        s.publish_once()
    assert a.read_once() == {"prefill-0": 0.5, "prefill-1": 1.0}
    assert b.read_once() == {"prefill-0": 2.0}
    assert la.backlog_s() == {"prefill-0": 2.5, "prefill-1": 1.0}
    assert la.own_backlog_s() == {"prefill-0": 2.0}  # what a publishes: its own, never the merge
    # A request done on b leaves b's next record; a's view follows at its next read.
    lb.done("prefill-1", "r3")
    lb.done("prefill-0", "r2")
    b.publish_once()
    assert a.read_once() == {"prefill-0": 0.0, "prefill-1": 0.0}
    rec = read_replicas(r, ns)
    assert set(rec) == {"a", "b"} and rec["a"]["inflight"] == 3 and rec["a"]["address"] == "127.0.0.1:a"
    # A clean stop removes the record at once.
    b.stop()
    assert set(read_replicas(r, ns)) == {"a"} and not r.exists(load_key(ns, "b"))
    a.stop()
    assert r.zcard(replicas_key(ns)) == 0


def test_a_killed_replicas_record_lapses_and_its_load_with_it(r):
    ns = f"rep-{uuid.uuid4().hex[:6]}"
    la, lk = PrefillLedger(), PrefillLedger()
    a, killed = _share(r, ns, "a", la), _share(r, ns, "k", lk, ttl_s=0.3)
    lk.add("prefill-0", "x", 4.0)
    killed.publish_once()  # then never again: SIGKILLed, nothing removed
    assert a.read_once() == {"prefill-0": 4.0}
    deadline = time.monotonic() + 10
    while a.read_once():
        assert time.monotonic() < deadline, "the killed replica's record never lapsed"
        time.sleep(0.05)
    assert la.backlog_s() == {} and r.zcard(replicas_key(ns)) == 0  # pruned from the set too


def test_redis_unreachable_keeps_the_last_figures_for_the_ttl_then_none(redis_url):
    from deploy.redis_server import RedisServer
    from kv_index.client import RedisTimeouts

    with RedisServer() as server:
        client = redis_client(server.url, RedisTimeouts(0.5, 0.5))
        ns = "rep-outage"
        la, lb = PrefillLedger(), PrefillLedger()
        a, b = _share(client, ns, "a", la, ttl_s=0.5), _share(client, ns, "b", lb, ttl_s=60)
        lb.add("prefill-0", "x", 1.5)
        b.publish_once()
        a.step()
        assert la.backlog_s() == {"prefill-0": 1.5}
        server.stop()
        a.step()  # within the ttl: the last figures stand
        assert la.backlog_s() == {"prefill-0": 1.5}
        time.sleep(0.6)
        a.step()
        assert la.backlog_s() == {} and a.others == {}
        client.close()


def _nodes():
    pre = [NodeInfo(f"prefill-{i}", Role.PREFILL, f"p{i}", "fp", 16, 1000) for i in range(2)]
    return [*pre, NodeInfo("decode-0", Role.DECODE, "d0", "fp", 16, 1000)]


def _place(ledger: PrefillLedger) -> str:
    policy = TtftPolicy(CostBook(), short_prompt_tokens=0)
    pl = policy.choose(PlacementRequest(2048, 16, max_tokens=8), _nodes(), {}, ledger.backlog_s())
    return pl.prefill_node.node_id


def test_two_replicas_do_not_both_pile_onto_one_node(r):
    """The negative control first: without sharing, b sees prefill-0 as idle as prefill-1 (ties go
    to the first id) and queues behind a's long prompt; with the records read, it takes the other."""
    ns = f"rep-{uuid.uuid4().hex[:6]}"
    la, lb = PrefillLedger(), PrefillLedger()
    first = _place(la)
    la.add(first, "long", 5.0)
    assert _place(lb) == first  # blind: the same node
    a, b = _share(r, ns, "a", la), _share(r, ns, "b", lb)
    a.publish_once()
    b.read_once()
    assert _place(lb) != first
    a.stop()
    b.stop()


def test_status_lists_the_live_replicas(r):
    from deploy.status_routers import render_routers, router_section

    ns = f"rep-{uuid.uuid4().hex[:6]}"
    la = PrefillLedger()
    la.add("prefill-0", "x", 0.25)
    a, b = _share(r, ns, "a", la), _share(r, ns, "b")
    a.publish_once()
    b.publish_once()
    rows = router_section(r, ns, time.time())
    assert [row["replica_id"] for row in rows] == ["a", "b"]
    assert rows[0]["backlog_s"] == {"prefill-0": 0.25} and rows[0]["inflight"] == 3
    text = "\n".join(render_routers(rows))
    assert "2 live replica(s)" in text and "127.0.0.1:a" in text and "250 ms" in text
    assert render_routers([]) == []
    a.stop()
    b.stop()


def test_merge_sums_the_others_per_node():
    recs = {"a": {"load": {"p0": 1.0}}, "b": {"load": {"p0": 0.5, "p1": 2.0}}, "c": {"load": {"p1": 1.0}}}
    assert merge_others(recs, "a") == {"p0": 0.5, "p1": 3.0}


def test_up_refuses_routers_it_cannot_run():
    from deploy.cluster_config import ClusterConfig, router_config
    from engine.config import EngineConfig

    eng = EngineConfig(model="m")
    with pytest.raises(ValueError, match="routers must be >= 1"):
        ClusterConfig(engine=eng, routers=0)
    with pytest.raises(ValueError, match=r"--routers 2 cannot be combined with --tls"):
        ClusterConfig(engine=eng, routers=2, tls=True)
    with pytest.raises(ValueError, match=r"--routers 3 cannot be combined with --api-key"):
        ClusterConfig(engine=eng, routers=3, api_keys=("k",))
    one = router_config(ClusterConfig(engine=eng), redis_url="redis://x", model_name="m", tokenizer_dir="t",
                        max_model_len=64)
    two = router_config(ClusterConfig(engine=eng, routers=2), redis_url="redis://x", model_name="m",
                        tokenizer_dir="t", max_model_len=64)
    assert (one.reuse_port, two.reuse_port) == (False, True)


def _listen(port: int, reuse: bool) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_http_front_doors_share_a_port_only_with_reuse_port():
    """What the HTTP server does with ``reuse_port`` (frontend/http_server.py), on real sockets."""
    first = _listen(0, reuse=True)
    port = first.getsockname()[1]
    second = _listen(port, reuse=True)
    with pytest.raises(OSError):
        _listen(port, reuse=False)
    for s in (first, second):
        s.close()


def test_pdserve_up_refuses_routers_with_tls_by_name(capsys):
    from deploy.cli import main

    assert main(["up", "--routers", "2", "--tls"]) == 2
    err = capsys.readouterr().err
    assert "--routers 2 cannot be combined with --tls" in err and "Helm chart" in err
