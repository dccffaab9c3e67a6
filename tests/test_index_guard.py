"""The router's decisions about a failing Redis, as plain logic: the lookup breaker (when to ask
the index, when to probe), the guarded lookup around it, and the node view's outage handling (a
registry that cannot be read is not an empty one; nodes kept until they register again). The
real faults (a frozen and a restarted Redis) are in tests/test_redis_faults.py."""
from __future__ import annotations

from dataclasses import replace

import pytest
import redis

from kv_index.client import RedisTimeouts
from kv_index.nodes import NodeInfo
from node.config import NodeConfig
from router.config import RouterConfig
from router.index_guard import GuardedLookup, LookupBreaker
from router.node_view import NodeRefresher


# ---------------------------------------------------------------------- the breaker
def test_a_failure_opens_the_breaker_until_a_probe_answers():
    b = LookupBreaker(base_s=0.5)
    assert b.allow() and not b.probe_due(0.0)
    b.lookup_failed(10.0, "timeout")
    assert not b.allow() and b.reason == "timeout" and b.open_since == 10.0
    assert not b.probe_due(10.4) and b.probe_due(10.5)
    b.probed(10.5, ok=False, reason="still frozen")  # a failed probe: wait base_s again, no backoff
    assert not b.allow() and b.reason == "still frozen" and b.retry_at == 11.0
    b.probed(11.0, ok=True)
    assert b.allow() and not b.is_open and b.reason == ""


def test_lookups_failing_right_after_a_probe_back_off_and_a_success_resets():
    b = LookupBreaker(base_s=0.5, max_s=3.0)
    b.lookup_failed(0.0, "slow")
    waits = []
    now = 0.0
    for _ in range(5):  # PING answers, the next lookup times out again: a slow, not a dead, Redis
        now = b.retry_at
        b.probed(now, ok=True)
        b.lookup_failed(now, "slow")
        waits.append(b.retry_at - now)
    assert waits == [1.0, 2.0, 3.0, 3.0, 3.0]  # doubled, capped at max_s
    b.probed(b.retry_at, ok=True)
    b.lookup_succeeded()  # the index answers lookups again
    b.lookup_failed(100.0, "blip")
    assert b.retry_at - 100.0 == 0.5


def test_a_failure_while_open_keeps_the_first_open_time():
    b = LookupBreaker(base_s=1.0)
    b.lookup_failed(1.0, "a")
    b.lookup_failed(1.5, "b")  # a lookup that was already in flight when the breaker opened
    assert b.open_since == 1.0 and b.reason == "b" and b.retry_at == 2.5 and b.flaps == 0


# ---------------------------------------------------------------------- the guarded lookup
class Reader:
    """Stands in for IndexReader: ``match`` answers or raises what Redis would."""

    def __init__(self) -> None:
        self.error: Exception | None = None
        self.calls = 0
        self.r = self  # the client the probe PINGs

    def match(self, hashes, node_ids):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return {n: len(hashes) for n in node_ids}

    def ping(self):
        if self.error is not None:
            raise self.error
        return True


def test_a_failed_lookup_places_without_the_index_and_skips_until_a_probe():
    reader, now = Reader(), [0.0]
    g = GuardedLookup(reader, LookupBreaker(base_s=1.0), clock=lambda: now[0])
    assert g.match([1, 2], ["a"]) == {"a": 2} and g.degraded is None
    reader.error = redis.TimeoutError("Timeout reading from socket")
    assert g.match([1, 2], ["a"]) == {}  # never raises: no prefix information
    assert g.failures == 1 and "Timeout reading" in g.degraded
    assert g.match([1], ["a"]) == {} and g.match([1], ["a"]) == {}
    assert reader.calls == 2 and g.skipped == 2  # skipped: nothing waited on Redis
    assert g.probe() is None  # not due yet
    now[0] = 1.0
    assert g.probe() is False and g.degraded is not None
    reader.error = None
    now[0] = 2.0
    assert g.probe() is True and g.degraded is None
    assert g.match([1], ["a"]) == {"a": 1}


def test_trip_opens_the_breaker_without_a_lookup():
    g = GuardedLookup(Reader(), clock=lambda: 0.0)
    g.trip("node registry unreadable: refused")
    assert g.match([1], ["a"]) == {} and g.skipped == 1 and "registry unreadable" in g.degraded


# ---------------------------------------------------------------------- the node view
def node(nid: str, role: str = "decode") -> NodeInfo:
    return NodeInfo(nid, role, f"127.0.0.1:{len(nid)}", "fp", 16, 64)


class Registry:
    """Stands in for IndexReader's registry read: nodes, or the error Redis gives."""

    def __init__(self, *nodes: NodeInfo) -> None:
        self.nodes = {n.node_id: n for n in nodes}
        self.error: Exception | None = None

    def live_nodes(self):
        if self.error is not None:
            raise self.error
        return dict(self.nodes)


def ids(view) -> list[str]:
    return sorted(n.node_id for n in view.nodes)


def test_an_unreadable_registry_keeps_the_last_nodes_and_trips_the_lookup():
    reg = Registry(node("decode-0"), node("prefill-0", "prefill"))
    lookup = GuardedLookup(Reader(), clock=lambda: 0.0)
    r = NodeRefresher(reg, refresh_s=0.1, prune_every_s=10.0, lookup=lookup)
    assert ids(r.refresh_once()) == ["decode-0", "prefill-0"] and r.degraded is None
    reg.error = redis.TimeoutError("Timeout reading from socket")
    for _ in range(3):  # however long it lasts (outage_grace_s None): not an empty registry
        view = r.refresh_once()
    assert ids(view) == ["decode-0", "prefill-0"] and "registry unreadable" in view.error
    assert "registry unreadable" in r.degraded and "placing by load" in r.degraded
    assert lookup.match([1], ["decode-0"]) == {}  # the request path does not wait on it either


def test_a_bounded_outage_grace_forgets_the_nodes():
    reg = Registry(node("decode-0"))
    r = NodeRefresher(reg, refresh_s=0.1, prune_every_s=10.0, outage_grace_s=0.0)
    r.refresh_once()
    reg.error = redis.ConnectionError("refused")
    view = r.refresh_once()
    assert view.nodes == () and "refused" in view.error


def test_after_an_outage_missing_nodes_are_kept_until_they_register_again(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("router.node_view.time.monotonic", lambda: now[0])
    reg = Registry(node("decode-0"), node("decode-1"))
    r = NodeRefresher(reg, refresh_s=0.1, prune_every_s=10.0, settle_s=5.0)
    r.refresh_once()
    reg.error = redis.TimeoutError("frozen")
    r.refresh_once()
    # Redis wakes: every lease ran out meanwhile; decode-1 heartbeats first.
    reg.error, reg.nodes = None, {"decode-1": replace(node("decode-1"), running=3)}
    now[0] = 101.0
    view = r.refresh_once()
    assert ids(view) == ["decode-0", "decode-1"] and "decode-0" in view.error and r.degraded
    assert next(n for n in view.nodes if n.node_id == "decode-1").running == 3  # the fresh entry wins
    reg.nodes["decode-0"] = node("decode-0")  # registers again: settled
    view = r.refresh_once()
    assert ids(view) == ["decode-0", "decode-1"] and view.error is None and r.degraded is None


def test_a_node_that_does_not_come_back_leaves_after_the_settle_time(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("router.node_view.time.monotonic", lambda: now[0])
    reg = Registry(node("decode-0"), node("decode-1"))
    r = NodeRefresher(reg, refresh_s=0.1, prune_every_s=10.0, settle_s=5.0)
    r.refresh_once()
    reg.error = redis.ConnectionError("refused")
    r.refresh_once()
    reg.error, reg.nodes = None, {"decode-1": node("decode-1")}  # restarted empty; decode-0 died
    now[0] = 1.0
    assert ids(r.refresh_once()) == ["decode-0", "decode-1"]
    now[0] = 6.0
    view = r.refresh_once()
    assert ids(view) == ["decode-1"] and view.error is None
    now[0] = 7.0  # a lease that lapses later is an ordinary dead node: gone at once
    reg.nodes = {}
    assert ids(r.refresh_once()) == []


# ---------------------------------------------------------------------- config
BASE = dict(redis_url="redis://x", model_name="m", tokenizer_dir="t", max_model_len=64)


@pytest.mark.parametrize("field", ["redis_connect_timeout_s", "redis_timeout_s", "index_lookup_timeout_s"])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_router_redis_timeouts_are_checked(field, bad):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**BASE, **{field: bad})


@pytest.mark.parametrize("field", ["redis_connect_timeout_s", "redis_timeout_s"])
def test_node_redis_timeouts_are_checked(field):
    with pytest.raises(ValueError, match=field):
        NodeConfig(node_id="d", role="decode", redis_url="redis://x", **{field: 0.0})
    with pytest.raises(ValueError, match="reply_s"):
        RedisTimeouts(reply_s=float("nan"))


def test_the_flags_set_the_timeouts():
    from deploy.nodes import add_arguments, template_from_args
    from engine.config import EngineConfig
    from frontend.server import build_parser

    a = build_parser().parse_args(["--redis-url", "redis://x", "--tokenizer-dir", "t", "--model-name", "m",
                                   "--max-model-len", "64", "--redis-connect-timeout", "0.3",
                                   "--redis-timeout", "1.5", "--index-lookup-timeout", "0.1"])
    assert (a.redis_connect_timeout_s, a.redis_timeout_s, a.index_lookup_timeout_s) == (0.3, 1.5, 0.1)
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    n = p.parse_args(["--redis-url", "redis://x", "--redis-connect-timeout", "0.4", "--redis-timeout", "3"])
    cfg = template_from_args(n, EngineConfig(), {}).config("decode", 0)
    assert (cfg.redis_connect_timeout_s, cfg.redis_timeout_s) == (0.4, 3.0)
