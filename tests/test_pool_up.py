"""`pdserve up --planner active --planner-resize` (deploy/launcher.py LocalCluster, its pool
controller deploy/pool_runners.py LocalPools) on the embedded cluster with a tiny random model:
pool targets written the way the planner writes them (kv_index/pool_targets.py) add a node
actor through Ray and remove it again, as the registry shows; and a node that never registers
(a real fault: its Redis accepts and never answers, and its process is frozen with SIGSTOP
before it could register) is given up on after the start bound, killed, never counted as
serving, and replaced by a fresh node that registers.

The planner itself stays quiet here: it decides nothing before ``min_requests`` finished
requests, and these tests send none, so the targets are the tests' alone."""
from __future__ import annotations

import os
import signal
import socket
import time
import uuid

import psutil
import pytest
import ray

from deploy.pool_controller import ADD, REMOVE
from deploy.ray_reap import KILL_GRACE_S
from kv_index.nodes import Role
from tests.helpers import wait_for

D = Role.DECODE
# A fresh node must register within this (LocalPools' start bound is the cluster's
# ready_timeout_s): ample for the tiny model on a busy 2-core machine, short enough to wait out.
START_TIMEOUT_S = 30.0
# The most a pass of the controller and Ray's kill may add to a bound (a pass every 0.5 s).
SLACK_S = 10.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from deploy.launcher import ClusterConfig, LocalCluster
    from engine.config import CacheConfig, EngineConfig
    from engine.models.tiny import save_tiny_chat_model

    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "chat", seed=3)
    config = ClusterConfig(engine=EngineConfig(model=str(model), dtype="float32", cache=CacheConfig(num_blocks=64)),
                           prefill_nodes=0, decode_nodes=1, grpc_port=0, http_port=None, dashboard_port=0,
                           namespace=f"pool-up-{uuid.uuid4().hex[:6]}", ready_timeout_s=START_TIMEOUT_S,
                           planner="active", planner_resize=True, planner_interval_s=0.5, planner_cooldown_s=0.0,
                           max_prefill_nodes=0, max_decode_nodes=2)
    with LocalCluster(config) as c:
        assert c.pools is not None  # --planner active --planner-resize: the controller runs
        yield c


@pytest.fixture
def stores(cluster):
    """(registry reader, pool targets) on the cluster's Redis; the pools back at one decode
    node afterwards, so each test starts from ``decode-0`` alone."""
    from kv_index.client import redis_client
    from kv_index.pool_targets import PoolTargets
    from kv_index.reader import IndexReader

    client = redis_client(cluster.redis_url)
    reader, targets = IndexReader(client, cluster.config.namespace), PoolTargets(client, cluster.config.namespace)
    assert wait_for(lambda: set(reader.live_nodes()) == {"decode-0"}, START_TIMEOUT_S, every=0.1)
    yield reader, targets
    targets.set({D: 1}, "test: back to one", by="planner@test")
    assert wait_for(lambda: set(reader.live_nodes()) == {"decode-0"} and named_actors() == ["decode-0"],
                    START_TIMEOUT_S + SLACK_S, every=0.1)
    client.close()


def named_actors() -> list[str]:
    return sorted(ray.util.list_named_actors())


def next_id(targets) -> str:
    """The id the pool controller gives the next decode node: above every one it made or
    removed before, and not decode-0's (the launcher's)."""
    return f"decode-{max(targets.issued()[D] + 1, 1)}"


def changes_since(targets, n: int) -> list:
    """The pool controller's actions after the first ``n`` of its log, oldest first."""
    return list(reversed(targets.changes(limit=50)))[n:]


def actions_since(targets, n: int) -> list[tuple[str, str]]:
    return [(c.action, c.node_id) for c in changes_since(targets, n)]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_up_adds_a_node_through_ray_and_removes_it_when_the_target_drops(cluster, stores):
    from deploy.status_pools import pool_section

    reader, targets = stores
    before = len(targets.changes(limit=50))
    new = next_id(targets)
    t0 = time.monotonic()
    targets.set({D: 2}, "test: more decode", by="planner@test")
    assert wait_for(lambda: set(reader.live_nodes()) == {"decode-0", new}, START_TIMEOUT_S + SLACK_S,
                    every=0.1)
    added_s = time.monotonic() - t0
    assert named_actors() == ["decode-0", new] and set(cluster.actors) == {"decode-0", new}
    pid = ray.get(cluster.actors[new].stats.remote(), timeout=30)["pid"]
    assert reader.live_nodes()[new].role is D
    assert pool_section(targets, reader.live_nodes(), time.time())["nodes"] == {"prefill": 0, "decode": 2}

    t1 = time.monotonic()
    targets.set({D: 1}, "test: fewer decode", by="planner@test")
    assert wait_for(lambda: set(reader.live_nodes()) == {"decode-0"}, 30 + SLACK_S, every=0.1)
    assert wait_for(lambda: named_actors() == ["decode-0"] and set(cluster.actors) == {"decode-0"}, SLACK_S)
    assert wait_for(lambda: gone(pid), SLACK_S, every=0.1)  # Ray ended its process
    removed_s = time.monotonic() - t1
    # The controller notes the change in Redis after the removal returns: the process can be
    # gone a moment before the note is written (CI saw the list with the add alone).
    assert wait_for(lambda: actions_since(targets, before) == [(ADD, new), (REMOVE, new)], SLACK_S,
                    every=0.1), actions_since(targets, before)
    assert "test: fewer decode" in changes_since(targets, before)[1].reason
    print(f"pdserve up pool change: add {added_s:.1f} s (target set -> registered), "
          f"remove {removed_s:.1f} s (target set -> drained, actor and process gone)")


def socket_owner(port: int) -> int:
    """The pid of the process whose TCP socket is bound to local port ``port`` on loopback."""
    for c in psutil.net_connections(kind="tcp"):
        if c.laddr and c.laddr.port == port and c.pid is not None:
            return c.pid
    raise LookupError(f"no process owns 127.0.0.1:{port}")


def test_a_node_that_never_registers_is_given_up_on_killed_and_replaced(cluster, stores):
    reader, targets = stores
    before = len(targets.changes(limit=50))
    frozen, conn, registered = None, None, set()
    hung = next_id(targets)  # node ids are never made twice: its replacement takes the next one
    fresh = f"decode-{int(hung.split('-')[1]) + 1}"

    def given_up() -> bool:
        registered.update(reader.live_nodes())
        return actions_since(targets, before)[:2] == [(ADD, hung), (REMOVE, hung)]

    # A Redis that accepts and never answers: the next decode node blocks in its first Redis call
    # (its health record, before the model loads), so it cannot register before the freeze.
    with socket.create_server(("127.0.0.1", 0)) as hole:
        hole.settimeout(START_TIMEOUT_S)
        cluster.node_fields[hung] = {"redis_url": f"redis://127.0.0.1:{hole.getsockname()[1]}/0",
                                     "redis_timeout_s": 600.0}
        try:
            t0 = time.monotonic()
            targets.set({D: 2}, "test: a node that hangs", by="planner@test")
            conn, peer = hole.accept()
            frozen = socket_owner(peer[1])
            os.kill(frozen, signal.SIGSTOP)
            del cluster.node_fields[hung]  # its replacement starts clean
            assert named_actors() == ["decode-0", hung]
            # Given up on after the start bound, not before: removed (never registered, no
            # second node added while it counted as starting), its actor and process ended.
            assert wait_for(given_up, START_TIMEOUT_S + KILL_GRACE_S + SLACK_S, every=0.1)
            given_up_s = time.monotonic() - t0
            assert given_up_s >= START_TIMEOUT_S - 1.0 and registered == {"decode-0"}
            assert f"{hung} did not register within 30 s" in changes_since(targets, before)[1].reason
            assert wait_for(lambda: gone(frozen), SLACK_S, every=0.1), "the frozen process outlived its removal"
            killed_s = time.monotonic() - t0
            # ... and a fresh node, under a fresh id, takes its place and registers.
            assert wait_for(lambda: set(reader.live_nodes()) == {"decode-0", fresh}, START_TIMEOUT_S + SLACK_S,
                            every=0.1)
            replaced_s = time.monotonic() - t0
            assert ray.get(cluster.actors[fresh].stats.remote(), timeout=30)["pid"] != frozen
            assert actions_since(targets, before) == [(ADD, hung), (REMOVE, hung), (ADD, fresh)]
        finally:
            cluster.node_fields.pop(hung, None)
            if frozen is not None and not gone(frozen):
                os.kill(frozen, signal.SIGCONT)
            if conn is not None:
                conn.close()
    print(f"never-registering node: given up after {given_up_s:.1f} s (bound {START_TIMEOUT_S:.0f} s), process gone "
          f"after {killed_s:.1f} s, replacement registered after {replaced_s:.1f} s")


# ---------------------------------------------------------------------- the SIGKILL backstop alone
def test_kill_worker_ends_a_frozen_ray_worker_and_spares_other_programs():
    """deploy/ray_reap.py kill_worker on real processes (no Ray needed): a frozen one titled
    like a Ray worker is SIGKILLed after the grace; another program with a reused pid is not."""
    import subprocess

    from deploy.ray_reap import kill_worker

    worker = subprocess.Popen(["bash", "-c", 'exec -a "ray::decode-9:NodeActor.__init__" sleep 60'])
    other = subprocess.Popen(["sleep", "60"])
    try:
        assert wait_for(lambda: psutil.Process(worker.pid).cmdline()[:1] == ["ray::decode-9:NodeActor.__init__"], 5)
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert kill_worker(worker.pid, grace_s=0.3) and worker.wait(timeout=5) == -signal.SIGKILL
        assert 0.3 <= time.monotonic() - t0 < 5.0
        assert not kill_worker(other.pid, grace_s=0.1) and other.poll() is None
        assert not kill_worker(worker.pid, grace_s=0.1)  # gone already: nothing to do
    finally:
        for p in (worker, other):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)
