"""Role wishes and pool targets that cannot outlive their cluster, empty a role, or flap the pools
(kv_index/roles.py, kv_index/pool_targets.py, node/role_switch.py, deploy/pool_controller.py):

- the issue's case, on the real Redis: a wish persisted by an earlier cluster (turn the only
  decode node prefill), then a fresh start on the same Redis through the launcher's own start
  path: the wish and the earlier targets are dropped, the node's poll switches nothing and every
  role is still served; a wish of this generation that would empty the decode role is refused by
  the floor, and obeyed once a second decode node registers;
- the floor is one script: two nodes leaving the last pair at once never both go;
- a switch that failed (the real fault: the new role's port is held by a socket here) is tried
  again, and succeeds once the port is free;
- the pool controller counts a node wished to another role in that role, so the planner's
  switch with its targets adds no node; its ids are never made twice, across a restart too;
- the planner writes its wishes with its targets in one transaction, floors and expiry on them.
Stand-in role servers stand for the node's (no engine, no Ray): the switch logic is what runs.
"""
from __future__ import annotations

import socket
import time
import uuid
from types import SimpleNamespace

import pytest
import redis
from prometheus_client import CollectorRegistry

import node.role_switch as role_switch
from deploy.pool_controller import ADD, SERVING, SWITCHING, PoolBounds, PoolController, PoolNode, decide, observe
from engine.config import EngineConfig
from kv_index.nodes import NodeInfo, Role
from kv_index.pool_targets import PoolTargets
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from kv_index.roles import RoleStore, decode_wish, desired_key, encode_wish, generation_and_time, switching_prefix
from node.config import NodeConfig
from node.role_switch import RoleSwitcher, held_unmovable, retry_delay
from telemetry.role_switch_metrics import RoleSwitchMetrics
from tests.helpers import wait_for

P, D = Role.PREFILL, Role.DECODE


class StandIn:
    """A role server without an engine: what RoleSwitcher touches. ``bind``: the port its start
    listens on (the real fault: a port another socket holds fails with EADDRINUSE)."""

    def __init__(self, config: NodeConfig, bind: int | None = None) -> None:
        self.config, self.role, self.bind = config, config.role, bind
        self.address = f"127.0.0.1:{bind or 1}"
        self.metrics = SimpleNamespace(registry=CollectorRegistry())
        self.sock = None

    def retire(self, timeout_s: float):
        return SimpleNamespace(engine=None, drained=True, failed=0)

    def start(self, handover) -> None:
        if self.bind is not None:
            self.sock = socket.create_server(("127.0.0.1", self.bind))


def factory(decode_port: int | None = None):
    built: list[Role] = []

    def build(config, engine=None):
        built.append(config.role)
        return StandIn(config, decode_port if config.role is D else None)

    build.roles = (P, D)
    build.built = built
    return build


def node_config(nid: str, role: Role, redis_url: str, ns: str) -> NodeConfig:
    return NodeConfig(node_id=nid, role=role, redis_url=redis_url, namespace=ns, engine=EngineConfig(model="tiny"),
                      drain_timeout_s=1.0)


def register(r: redis.Redis, ns: str, nid: str, role: Role, draining: bool = False) -> NodePublisher:
    pub = NodePublisher(r, NodeInfo(nid, role, "127.0.0.1:1", "fp", 4, 32), ns=ns, lease_s=60.0)
    pub.register()
    pub.heartbeat({"draining": int(draining)})
    return pub


def switcher_for(server: StandIn, build) -> RoleSwitcher:
    return RoleSwitcher(server, build, RoleSwitchMetrics("m", server.config.node_id))


@pytest.fixture
def ns_redis(redis_url):
    r = redis.Redis.from_url(redis_url, socket_timeout=5)
    yield f"wish-{uuid.uuid4().hex[:6]}", r
    r.close()


def fresh_up(redis_url: str, ns: str) -> None:
    """What `pdserve up` does to Redis before it spawns a node (deploy/launcher.py)."""
    from deploy.launcher import ClusterConfig, LocalCluster

    LocalCluster(ClusterConfig(engine=EngineConfig(model="m"), redis_url=redis_url, namespace=ns))._forget_node_health()


# ---------------------------------------------------------------------- the case
def test_a_wish_from_an_earlier_cluster_never_turns_the_only_decode_node(redis_url, ns_redis, monkeypatch):
    ns, r = ns_redis
    monkeypatch.setattr(role_switch, "RETRY_BASE_S", 0.05)
    roles, targets = RoleStore(r, ns), PoolTargets(r, ns)
    # The earlier run: an active planner turned decode-0 prefill (pools 2P + 0D), and its Redis persists.
    fresh_up(redis_url, ns)
    targets.set({P: 2, D: 0}, "earlier run", wishes={"decode-0": P}, ttl_s=86400.0)
    r.hset(desired_key(ns), "decode-1", "prefill")  # an older build's bare wish: no generation, no expiry
    assert roles.desired("decode-0") is P and targets.get() == {P: 2, D: 0}

    fresh_up(redis_url, ns)  # a fresh `pdserve up` on the same Redis, node ids as before
    assert roles.all() == {} and targets.record() is None  # dropped: the controller's defaults apply
    for nid, role in (("prefill-0", P), ("decode-0", D)):
        register(r, ns, nid, role)
    build = factory()
    decode0 = switcher_for(StandIn(node_config("decode-0", D, redis_url, ns)), build)
    for _ in range(3):  # heartbeats
        decode0.poll(roles)
    assert build.built == [] and decode0.server.role is D
    assert {n: i.role for n, i in IndexReader(r, ns).live_nodes().items()} == {"prefill-0": P, "decode-0": D}

    # A wish of this generation that would empty the decode role (a planner bug, a hand-written
    # one): the floor refuses it, and the node tries again until another decode node serves.
    roles.request("decode-0", P, "test: the last decode node")
    decode0.poll(roles)
    assert wait_for(lambda: decode0._attempt is not None and decode0._attempt.retry_at < float("inf"), 5)
    for _ in range(3):
        decode0.poll(roles)
        time.sleep(0.06)
    assert build.built == [] and decode0.server.role is D
    register(r, ns, "decode-1", D)
    assert wait_for(lambda: (decode0.poll(roles), decode0.server.role)[1] is P, 10, every=0.05)
    assert build.built == [P]
    assert wait_for(lambda: r.exists(switching_prefix(ns) + "decode-0") == 0, 5)  # the claim released


def test_the_floor_is_one_script_two_nodes_leaving_the_last_pair_never_both_go(ns_redis):
    ns, r = ns_redis
    roles = RoleStore(r, ns)
    for nid in ("decode-0", "decode-1"):
        register(r, ns, nid, D)
    register(r, ns, "decode-2", D, draining=True)  # on its way out: not counted
    assert roles.claim("decode-0", D, 1, 30.0) == (True, 1)
    assert roles.claim("decode-1", D, 1, 30.0) == (False, 0)  # decode-0 claimed: it no longer counts
    roles.release("decode-0")
    assert roles.claim("decode-1", D, 1, 30.0) == (True, 1)


def test_a_failed_switch_is_tried_again(redis_url, ns_redis, monkeypatch):
    ns, r = ns_redis
    monkeypatch.setattr(role_switch, "RETRY_BASE_S", 0.05)
    held = socket.create_server(("127.0.0.1", 0))  # the decode role's port, taken
    port = held.getsockname()[1]
    build = factory(decode_port=port)
    p0 = switcher_for(StandIn(node_config("prefill-0", P, redis_url, ns)), build)
    roles = RoleStore(r, ns)
    roles.request("prefill-0", D, "test")
    p0.poll(roles)
    assert wait_for(lambda: build.built == [D, P] and not p0.lock.locked(), 10)  # failed: back to prefill
    assert p0.server.role is P
    held.close()
    assert wait_for(lambda: (p0.poll(roles), p0.server.role)[1] is D, 10, every=0.05)
    assert build.built == [D, P, D] and p0.server.sock.getsockname()[1] == port
    p0.server.sock.close()


# ---------------------------------------------------------------------- wishes, pure
def test_a_wish_stands_in_its_generation_until_it_expires_unless_refused():
    raw = encode_wish(D, "why", "g1", 100.0, 10.0, {P: 2})
    w = decode_wish(raw.encode(), "g1", 105.0)
    assert (w.role, w.reason, w.until, w.floor(P), w.floor(D), w.refused) == (D, "why", 110.0, 2, 1, "")
    assert decode_wish(raw.encode(), "g2", 105.0) is None  # another generation
    assert decode_wish(raw.encode(), "g1", 110.0) is None  # expired
    assert decode_wish(b"decode", "", 0.0) is None  # an older build's bare role: neither
    refusal = f'{{"id": "{w.wish_id}", "reason": "speculative"}}'.encode()
    assert decode_wish(raw.encode(), "g1", 105.0, refusal).refused == "speculative"
    assert decode_wish(raw.encode(), "g1", 105.0, b'{"id": "other", "reason": "x"}').refused == ""
    assert encode_wish(D, "", "g", 0.0, 1.0, {D: 0})  # a floor below the default is the default
    assert decode_wish(encode_wish(P, "", "g", 0.0, 1.0, {D: 0}).encode(), "g", 0.5).floor(D) == 1
    for bad in (dict(ttl_s=0.0), dict(ttl_s=float("inf")), dict(floors={D: -1})):
        with pytest.raises(ValueError):
            encode_wish(D, "", "g", 0.0, **{"ttl_s": 1.0, **bad})
    assert [retry_delay(t) for t in (1, 2, 3)] == [2.0, 4.0, 8.0] and retry_delay(50) == role_switch.RETRY_MAX_S


def test_requests_that_could_not_move_are_counted():
    def seq(rid, n, forked=False, out=0):
        return SimpleNamespace(request_id=rid, params=SimpleNamespace(n=n), forked=forked, num_output_tokens=out)

    sched = SimpleNamespace(waiting=[seq("a", 2)], running=[seq("b", 2, forked=True), seq("b", 2, forked=True),
                                                             seq("c", 1, out=5), seq("d", 3, out=1)])
    assert held_unmovable(SimpleNamespace(scheduler=sched)) == 2  # b and d; a has no output yet: it moves


def test_expired_wishes_and_targets_are_none(ns_redis):
    ns, r = ns_redis
    gen, now = generation_and_time(r, ns)
    r.hset(desired_key(ns), "decode-0", encode_wish(P, "", gen, now - 100.0, 10.0))
    assert RoleStore(r, ns).wish("decode-0") is None
    targets = PoolTargets(r, ns)
    targets.set({D: 3}, "soon gone", ttl_s=0.05)
    time.sleep(0.1)
    rec = targets.record()
    assert rec is not None and rec.expired and targets.get() == {}


# ---------------------------------------------------------------------- the pool controller
def test_a_switch_with_its_targets_adds_no_node():
    """1P + 2D, the planner moves decode-1 to prefill with targets 2P + 1D (--planner-resize)."""
    def info(nid, role, **kw):
        return NodeInfo(nid, role, "127.0.0.1:1", "fp", 4, 32, **kw)

    names = ["prefill-0", "decode-0", "decode-1"]
    bounds = PoolBounds({P: 0, D: 1}, {P: 3, D: 3})
    kw = dict(now=100.0, last_change_at=None, cooldown_s=0.0)
    for draining in (False, True):  # before the switch, and during its drain
        reg = {"prefill-0": info("prefill-0", P), "decode-0": info("decode-0", D),
               "decode-1": info("decode-1", D, draining=draining)}
        nodes = observe(names, reg, {}, 1.0, wishes={"decode-1": P})
        assert PoolNode("decode-1", P, SWITCHING) in nodes
        assert decide(nodes, {P: 2, D: 1}, bounds, **kw).change is None
        # what the controller did before it read the wishes: a node added, to go again later
        assert decide(observe(names, reg, {}, 1.0), {P: 2, D: 1}, bounds, **kw).change.action == ADD
    # a switching node is never the one removed
    nodes = [PoolNode("decode-0", D), PoolNode("prefill-0", D, SWITCHING)]
    assert decide(nodes, {D: 1}, bounds, **kw).change is None


def test_node_ids_are_never_made_twice_across_a_controller_restart(ns_redis):
    ns, r = ns_redis
    actors = ["decode-0"]
    spawned: list[str] = []

    class Controller(PoolController):
        def _actor_names(self):
            return list(actors)

        def _remove(self, name, drain=True):
            actors.remove(name)

    def controller():
        return Controller(r, ns, PoolBounds({P: 0, D: 1}, {P: 2, D: 3}),
                          lambda role, nid: (spawned.append(nid), actors.append(nid)), cooldown_s=0.0)

    register(r, ns, "decode-0", D)
    targets = PoolTargets(r, ns)
    targets.set({D: 2}, "up")
    controller().step()
    targets.set({D: 1}, "down")
    c = controller()
    c.step()  # decode-1 is starting: removed first
    assert actors == ["decode-0"]
    targets.set({D: 2}, "up again")
    controller().step()  # a restarted controller
    assert spawned == ["decode-1", "decode-2"] and targets.issued()[D] == 2
    assert decide([PoolNode("decode-0", D, SERVING)], {D: 2}, PoolBounds(), now=0.0, last_change_at=None,
                  cooldown_s=0.0, issued={D: 7}).change.node_id == "decode-8"


# ---------------------------------------------------------------------- the planner
def test_the_planner_writes_its_wishes_with_its_targets(ns_redis):
    from kv_index.plan import PlanStore
    from router.planner.config import PlannerConfig
    from router.planner.decide import SWITCH_ROLES, Decision
    from router.planner.loop import PlannerLoop
    from router.planner.model import Layout

    ns, r = ns_redis
    roles, targets = RoleStore(r, ns), PoolTargets(r, ns)
    cfg = PlannerConfig(mode="active", resize=True, min_prefill_nodes=1, max_prefill_nodes=3, max_decode_nodes=3,
                        wish_ttl_s=120.0)
    loop = PlannerLoop(cfg, PlanStore(r, ns), roles, targets, signals=lambda: None, apply_threshold=lambda t: None,
                       holder="test")
    loop._act(Decision(SWITCH_ROLES, "prefill_bound", "test", Layout(2, 1, 64), 64, roles={"decode-1": P},
                       pool_targets={P: 2, D: 1}))
    w = roles.wish("decode-1")
    _, now = generation_and_time(r, ns)
    assert w.role is P and (w.floor(P), w.floor(D)) == (1, 1) and now + 100 < w.until <= now + 120.5
    rec = targets.record()
    assert rec.targets == {P: 2, D: 1} and not rec.expired and rec.until == pytest.approx(w.until, abs=0.01)
