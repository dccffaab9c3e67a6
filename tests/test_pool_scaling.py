"""Pool sizes that follow targets (deploy/pool_controller.py, kv_index/pool_targets.py): the
pure decision on plain data, the targets in a real Redis, and a pool that grows and shrinks
through `pdserve nodes --follow-targets` on a local Ray cluster with a tiny random-weight model,
the removed node drained (its stream finishes), not killed mid-request."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import grpc
import pytest
import redis

from deploy.pool_controller import (
    ADD,
    DOWN,
    DRAINING,
    REMOVE,
    SERVING,
    STARTING,
    PoolBounds,
    PoolChange,
    PoolNode,
    decide,
    observe,
    wanted,
)
from kv_index.nodes import NodeInfo, Role
from kv_index.pool_targets import PoolTargets
from kv_index.reader import IndexReader
from tests.clusters import ray_pools
from tests.helpers import REPO, wait_for

P, D = Role.PREFILL, Role.DECODE
BOUNDS = PoolBounds({P: 0, D: 1}, {P: 3, D: 3})


def nodes(*specs) -> list[PoolNode]:
    """("decode-0", load) or ("decode-0", load, state)."""
    out = []
    for nid, load, *state in specs:
        out.append(PoolNode(nid, Role(nid.split("-")[0]), state[0] if state else SERVING, load=load))
    return out


def step(ns, targets, *, now=100.0, last=None, cooldown=10.0, **kw):
    return decide(ns, targets, BOUNDS, now=now, last_change_at=last, cooldown_s=cooldown, **kw)


# ---------------------------------------------------------------------- the pure decision
def test_scale_up_takes_a_fresh_id():
    ns = nodes(("prefill-0", 0), ("decode-0", 2), ("decode-2", 0))
    d = step(ns, {D: 3}, note="decode queue 4.1 s")
    assert d.change == PoolChange(D, ADD, "decode-1", "decode nodes 2 -> 3 (decode queue 4.1 s)")
    # an id some other actor or registry entry holds is not fresh
    assert step(ns, {D: 3}, taken={"decode-1"}).change.node_id == "decode-3"
    # adding goes before removing, the largest shortfall first
    assert step(ns, {P: 0, D: 3}).change.action == ADD
    assert step(nodes(("decode-0", 0)), {P: 2, D: 2}).change.role is P


def test_scale_down_removes_the_idlest():
    ns = nodes(("decode-0", 3), ("decode-1", 0), ("decode-2", 5))
    d = step(ns, {D: 2})
    assert (d.change.action, d.change.node_id) == (REMOVE, "decode-1")
    assert "idlest" in d.change.reason and "3 -> 2" in d.change.reason
    # a node still starting goes first (nothing in flight there); equal load: the newest name
    assert step(ns + nodes(("decode-3", 0, STARTING)), {D: 3}).change.node_id == "decode-3"
    assert step(nodes(("decode-0", 1), ("decode-1", 1)), {D: 1}).change.node_id == "decode-1"


def test_bounds_clamp_targets():
    ns = nodes(("prefill-0", 0), ("decode-0", 0), ("decode-1", 0), ("decode-2", 0))
    assert step(ns, {D: 9}).change is None  # at the maximum already
    assert step(ns, {D: 0}).change.node_id == "decode-2"  # down toward the minimum (1), one at a time
    assert step(nodes(("decode-0", 0)), {D: 0}).change is None
    assert step(nodes(("decode-0", 0)), {P: 7}).change == PoolChange(P, ADD, "prefill-0", "prefill nodes 0 -> 3")
    # a role without a target keeps its size, but never outside the bounds
    assert wanted(nodes(("decode-0", 0)) * 5, {}, BOUNDS)[D] == (5, 3)
    assert step([], {}).change == PoolChange(D, ADD, "decode-0", "decode nodes 0 -> 1")


def test_bounds_that_cannot_hold_are_refused():
    with pytest.raises(ValueError, match=r"min prefill nodes \(3\) is above max prefill nodes \(2\)"):
        PoolBounds({P: 3, D: 1}, {P: 2, D: 4})
    with pytest.raises(ValueError, match="min decode nodes must be >= 1"):
        PoolBounds({P: 0, D: 0}, {})
    with pytest.raises(ValueError, match="min prefill nodes must be >= 0"):
        PoolBounds({P: -1, D: 1}, {})
    assert PoolBounds().clamp(D, 0) == 1 and PoolBounds().clamp(P, 40) == 40


def test_cool_down_and_one_change_at_a_time():
    ns = nodes(("decode-0", 0))
    d = step(ns, {D: 2}, now=105.0, last=100.0, cooldown=10.0)
    assert d.change is None and d.why.startswith("cool-down: 5.0 s left")
    assert step(ns, {D: 2}, now=110.0, last=100.0, cooldown=10.0).change.action == ADD
    # the node just added is still loading: no second one until it registers
    ns2 = ns + [PoolNode("decode-1", D, STARTING, starting_s=20.0)]
    d = step(ns2, {D: 3}, start_timeout_s=60.0)
    assert d.change is None and "decode-1" in d.why
    # ... but one that never registers is removed to make way for a fresh try
    stuck = ns + [PoolNode("decode-1", D, STARTING, starting_s=61.0)]
    assert step(stuck, {D: 3}, start_timeout_s=60.0).change == \
        PoolChange(D, REMOVE, "decode-1", "decode-1 did not register within 60 s")


def test_never_the_last_decode_node():
    # one serving decode node and one draining: removing would leave none that serves
    ns = nodes(("decode-0", 0), ("decode-1", 0, DRAINING))
    assert wanted(ns, {}, BOUNDS)[D] == (1, 1)  # draining nodes are not counted
    assert step(ns, {D: 1}).change is None
    # a target the bounds allow never removes the last decode node that serves: with a starting
    # one beside it, the starting one goes
    ns = nodes(("decode-0", 0), ("decode-1", 0, STARTING))
    assert step(ns, {D: 1}).change.node_id == "decode-1"
    assert step(nodes(("decode-0", 0)), {D: 0}).change is None  # the minimum (1) holds
    # and should bounds ever allow 0 (they refuse it: below), the decision still holds it
    loose = object.__new__(PoolBounds)
    object.__setattr__(loose, "minimum", {D: 0})
    object.__setattr__(loose, "maximum", {})
    d = decide(nodes(("decode-0", 0), ("decode-1", 0, DRAINING)), {D: 0}, loose, now=0.0, last_change_at=None,
               cooldown_s=0.0)
    assert d.change is None and "no serving decode node" in d.why
    # a node switched live to decode counts as decode, and may be the one removed
    switched = [PoolNode("decode-0", D, load=4), PoolNode("prefill-0", D, load=0)]
    assert step(switched, {D: 1}).change == PoolChange(D, REMOVE, "prefill-0",
                                                       "decode nodes 2 -> 1; prefill-0 is the idlest (load 0)")


def test_a_node_that_stays_down_keeps_its_place():
    """`pdserve nodes`: a node that failed its starts (health record DOWN, no actor) is not
    replaced by a fresh spawn every cool-down; it is the first to go when the pool shrinks."""
    ns = nodes(("decode-0", 0), ("decode-1", 0, DOWN))
    assert wanted(ns, {D: 2}, BOUNDS)[D] == (2, 2) and step(ns, {D: 2}).change is None
    d = step(nodes(("decode-0", 0), ("decode-1", 0), ("decode-2", 3, DOWN)), {D: 2})
    assert (d.change.action, d.change.node_id) == (REMOVE, "decode-2") and "stays down" in d.change.reason
    got = observe(["decode-0"], {}, {}, now=1.0, down=["decode-0", "decode-3", "other"])
    assert [(n.node_id, n.state) for n in got] == [("decode-3", DOWN), ("decode-0", STARTING)]


def test_observe_joins_actors_with_the_registry():
    def info(nid, role, **kw):
        return NodeInfo(nid, role, "127.0.0.1:1", "fp", 4, 32, **kw)

    seen: dict[str, float] = {"gone-0": 1.0, "decode-1": 5.0}
    reg = {"decode-0": info("decode-0", "decode", waiting=2, running=3, running_tokens=70),
           "prefill-0": info("prefill-0", "decode", draining=True), "router-x": info("router-x", "decode")}
    got = observe(["decode-0", "decode-1", "prefill-0", "my-actor"], reg, seen, now=9.0)
    assert got == [PoolNode("decode-0", D, SERVING, load=5, running_tokens=70),
                   PoolNode("decode-1", D, STARTING, starting_s=4.0),
                   PoolNode("prefill-0", D, DRAINING)]
    assert seen == {"decode-1": 5.0}  # forgotten: actors gone, or registered


# ---------------------------------------------------------------------- targets in Redis
@pytest.fixture
def targets(redis_url):
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    yield PoolTargets(client, f"pt-{uuid.uuid4().hex[:6]}")
    client.close()


def test_pool_targets_round_trip(targets):
    assert targets.get() == {} and targets.record() is None
    t0 = time.time()
    targets.set({P: 2, D: 3}, "prefill queue over the SLO", by="planner@r1")
    rec = targets.record()
    assert rec.targets == {P: 2, D: 3} and (rec.reason, rec.by) == ("prefill queue over the SLO", "planner@r1")
    assert t0 - 1 <= rec.at <= time.time() + 1
    targets.set({"decode": 1})  # replaces: prefill has no target any more
    assert targets.get() == {D: 1} and targets.record().by  # a default author (host:pid)
    for bad in ({P: -1}, {D: 1.5}, {D: True}):
        with pytest.raises(ValueError, match="pool target"):
            targets.set(bad)
    with pytest.raises(ValueError):
        targets.set({"both": 1})
    assert targets.get() == {D: 1}  # a refused set changes nothing
    targets.clear()
    assert targets.get() == {}


def test_pool_changes_are_logged_newest_first(targets):
    from kv_index.pool_targets import CHANGES_KEPT

    for i in range(CHANGES_KEPT + 5):
        targets.note_change(D, ADD, f"decode-{i}", "why")
    got = targets.changes(limit=3)
    assert [c.node_id for c in got] == [f"decode-{CHANGES_KEPT + 4 - i}" for i in range(3)]
    assert got[0].role is D and got[0].action == ADD and got[0].reason == "why"
    assert len(targets.changes(limit=1000)) == CHANGES_KEPT


def test_pool_targets_calls_are_bounded(redis_server):
    """A Redis that stops answering (SIGSTOP) costs a targets read its client's reply bound."""
    from kv_index.client import RedisTimeouts, redis_client

    client = redis_client(redis_server.url, RedisTimeouts(connect_s=0.5, reply_s=0.3))
    store = PoolTargets(client, f"pt-{uuid.uuid4().hex[:6]}")
    store.get()  # connected
    with redis_server.frozen():
        t0 = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            store.get()
        assert time.monotonic() - t0 < 3.0
    assert store.get() == {}  # answers again once Redis does
    client.close()


# ---------------------------------------------------------------------- `pdserve nodes --follow-targets` on Ray
def model_with_tokenizer(tiny_dir, dest):
    """The tiny model with a word-level tokenizer over its whole vocabulary beside it (decode
    nodes load one; every sampled id detokenizes)."""
    import json
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    shutil.copytree(tiny_dir, dest)
    vocab = json.loads((dest / "config.json").read_text())["vocab_size"]
    Tokenizer(WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w1")).save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2"}))
    return dest


@pytest.fixture(scope="module")
def scaling_ray():
    """A local Ray (this test process is its driver) with room for two decode nodes."""
    pytest.importorskip("ray")
    yield from ray_pools(0, 2, prefix="scale")  # its shutdown ends the detached node actors with the cluster


def stream_decode(address: str, rid: str, max_tokens: int, out: dict, ended: dict) -> None:
    """One request straight to a decode node (it prefills the prompt itself); ``out[rid]``: the
    tokens received and the finish reason, or the error; ``ended[rid]``: when it ended."""
    from protos.convert import sampling_to_proto
    from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc, serving_pb2
    from tests.helpers import prompt, tokens_of
    from tokens.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    try:
        with grpc.insecure_channel(address) as ch:
            msgs = list(kv_pb2_grpc.DecodeNodeStub(ch).Decode(kv_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=prompt(len(out), 12), sampling=sampling_to_proto(params)),
                timeout=60))
        done = [m.complete for m in msgs if m.WhichOneof("kind") == "complete"]
        out[rid] = (len(tokens_of(msgs)), serving_pb2.FinishReason.Name(done[0].finish_reason) if done else None)
    except grpc.RpcError as e:
        out[rid] = e
    ended[rid] = time.monotonic()


def test_a_pool_grows_and_shrinks_through_pdserve_nodes(tiny_dir, redis_url, scaling_ray, tmp_path):
    ray = scaling_ray
    ns = f"scale-{uuid.uuid4().hex[:6]}"
    model = model_with_tokenizer(tiny_dir, tmp_path / "model")
    gcs = ray.get_runtime_context().gcs_address
    r = redis.Redis.from_url(redis_url, socket_timeout=5)
    reader_ns = IndexReader(r, ns)
    targets = PoolTargets(r, ns)
    cmd = [sys.executable, "-m", "deploy.cli", "nodes", "--ray-address", gcs, "--redis-url", redis_url, "--namespace", ns, "--host", "127.0.0.1",
           "--prefill-nodes", "0", "--decode-nodes", "1", "--follow-targets", "--max-decode-nodes", "2",
           "--pool-cooldown-s", "0", "--interval-s", "0.2", "--drain-timeout", "30", "--lease-s", "2",
           "--metrics-port", "-1", "--model", str(model), "--device", "cpu", "--threads", "1", "--block-size", "4",
           "--kv-cache-mib", "1", "--max-num-batched-tokens", "64", "--max-num-seqs", "4"]
    log_path = tmp_path / "nodes.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert wait_for(lambda: set(reader_ns.live_nodes()) == {"decode-0"}, 60, every=0.1), log_path.read_text()

        t0 = time.monotonic()
        targets.set({D: 2}, "test: more decode")
        assert wait_for(lambda: set(reader_ns.live_nodes()) == {"decode-0", "decode-1"}, 60, every=0.1), \
            log_path.read_text()
        added_s = time.monotonic() - t0
        targets.set({D: 5}, "test: above the maximum")  # clamped to --max-decode-nodes 2: nothing more

        # Two streams on decode-0, one on decode-1: decode-1 is the idlest, the one to go, and
        # its stream (slowed down, so the drain catches it mid-way) must finish, not break.
        for nid in ("decode-0", "decode-1"):
            ray.get(ray.get_actor(nid, namespace=ns).set_step_delay.remote(0.03), timeout=30)
        live = reader_ns.live_nodes()
        out: dict = {}
        ended: dict = {}
        streams = [threading.Thread(target=stream_decode, args=(live[nid].grpc_address, rid, 100, out, ended))
                   for nid, rid in (("decode-0", "a"), ("decode-0", "b"), ("decode-1", "c"))]
        for t in streams:
            t.start()
        assert wait_for(lambda: (reader_ns.live_nodes()["decode-0"].running, reader_ns.live_nodes()["decode-1"].running)
                        == (2, 1), 20, every=0.05)
        t1 = time.monotonic()
        targets.set({D: 1}, "test: fewer decode")
        saw_draining = wait_for(lambda: getattr(reader_ns.live_nodes().get("decode-1"), "draining", False), 10,
                                every=0.02)
        draining_at = time.monotonic()
        assert wait_for(lambda: set(reader_ns.live_nodes()) == {"decode-0"}, 60, every=0.05), log_path.read_text()
        removed_s = time.monotonic() - t1
        for t in streams:
            t.join(timeout=60)
        assert out == {rid: (100, "FINISH_REASON_LENGTH") for rid in "abc"}  # none cut short
        assert saw_draining  # routers were told to place nothing new there while it finished
        assert ended["c"] > draining_at  # ... and its stream was still running then: drained, not cut
        # it left the index at the end of its drain; its actor ends just after
        assert wait_for(lambda: [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                                 if a["namespace"] == ns] == ["decode-0"], 15, every=0.05)
        changes = targets.changes()
        assert [(c.action, c.node_id) for c in changes] == [(REMOVE, "decode-1"), (ADD, "decode-1"),
                                                             (ADD, "decode-0")]  # decode-0: --decode-nodes 1
        assert "test: fewer decode" in changes[0].reason and "idlest" in changes[0].reason
        print(f"pool change: add {added_s:.1f} s (target set -> registered), remove {removed_s:.1f} s "
              f"(target set -> drained and gone, one 100-token stream in flight)")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        r.close()


# ---------------------------------------------------------------------- where the bounds come from
def test_pdserve_nodes_refuses_bounds_that_cannot_hold(capsys):
    from deploy.cli import main

    with pytest.raises(SystemExit, match=r"min decode nodes \(3\) is above max decode nodes \(2\)"):
        main(["nodes", "--redis-url", "redis://127.0.0.1:1/0", "--follow-targets", "--min-decode-nodes", "3",
              "--max-decode-nodes", "2", "--ray-address", "127.0.0.1:1", "--connect-timeout-s", "0.1"])


def test_pdserve_up_follows_targets_only_when_the_planner_resizes():
    from deploy.launcher import ClusterConfig
    from deploy.pool_runners import local_pool_resources, planner_pools
    from engine.config import EngineConfig

    def up(**kw):
        return ClusterConfig(engine=EngineConfig(model="m"), **kw)

    assert planner_pools(up()) is None  # advisory by default: it changes nothing
    assert local_pool_resources(up()) == {"prefill_pool": 1, "decode_pool": 1}
    sized = dict(max_prefill_nodes=3, max_decode_nodes=2)
    assert planner_pools(up(planner="active", **sized)) is None  # roles only, unless --planner-resize
    assert planner_pools(up(planner="advisory", planner_resize=True, **sized)) is None
    b = planner_pools(up(planner="active", planner_resize=True, min_decode_nodes=1, **sized))
    assert (b.low(P), b.high(P), b.low(D), b.high(D)) == (0, 3, 1, 2)
    # its private Ray has room for the largest pools allowed
    assert local_pool_resources(up(planner="active", planner_resize=True, **sized)) == \
        {"prefill_pool": 3, "decode_pool": 2}


def test_status_shows_targets_and_changes(targets):
    from deploy.status_pools import pool_section, render_pools

    def info(nid, role, **kw):
        return NodeInfo(nid, role, "127.0.0.1:1", "fp", 4, 32, **kw)

    assert pool_section(targets, {}, time.time()) is None  # nothing set, nothing changed: no lines
    targets.set({D: 2}, "decode queue over the SLO", by="planner@r0")
    targets.note_change(D, ADD, "decode-1", "decode nodes 1 -> 2 (decode queue over the SLO)")
    nodes_now = {"decode-0": info("decode-0", "decode"), "decode-1": info("decode-1", "decode", draining=True),
                 "prefill-0": info("prefill-0", "prefill")}
    sec = pool_section(targets, nodes_now, time.time())
    assert sec["targets"] == {"decode": 2} and sec["nodes"] == {"prefill": 1, "decode": 1}
    text = "\n".join(render_pools(sec))
    assert "pool sizes (now/target): prefill 1/-, decode 1/2" in text and "by planner@r0" in text
    assert "add decode-1: decode nodes 1 -> 2" in text
