"""Scenarios for the index on Redis Cluster (`pdserve chaos --redis-cluster N`): the master that
serves the index's slot is frozen (redis-shard-hang) or killed (redis-failover) mid-stream.

    masters   m0 [index slot: every key under the namespace's hash tag]   m1   m2
    replicas  r0 (follows m0)                                             r1   r2

The index is one hash tag, so one master holds all of it (docs/cluster.md, "The index on Redis
Cluster"): the fault that matters is that master's. Either way the index is a hint: the router
places by its last node view while Redis does not answer (``degraded``), the nodes keep
serving, and once a master answers for the slot again (the same one thawed, or its replica
promoted by the cluster after ``cluster-node-timeout``) the nodes' heartbeats and the router's
refresh carry on. Nothing may be lost, and every answer must equal the fault-free run's.
"""
from __future__ import annotations

import os
import signal
import time

from chaos.context import Outcome, Run, hold
from chaos.faults import FREEZER
from chaos.scenario_infra import degraded


def _cluster(run: Run):
    cl = run.cluster
    if cl.redis is None or not hasattr(cl.redis, "master_for"):
        raise ValueError("this scenario needs the cluster's own Redis Cluster: pdserve chaos --redis-cluster N")
    return cl.redis


def _index_key(run: Run) -> str:
    from kv_index.schema import nodes_key

    return nodes_key(run.cluster.namespace)  # every index key shares its slot (one hash tag)


def _index_master_port(rc, key: str) -> int | None:
    try:
        return rc.master_for(key).port
    except RuntimeError:  # no live node serves the slot right now
        return None


def redis_shard_hang(run: Run) -> Outcome:
    """The index's master stops (SIGSTOP) while the first half of the streams runs; the second
    half is sent meanwhile; it continues after ``freeze_s``. With a replica and a freeze past
    ``cluster-node-timeout`` the cluster may promote the replica meanwhile (``failed_over``):
    either way the router says ``degraded`` (``detect_s``) and recovers (``recovered_s``)."""
    from chaos.cluster import wait_for

    rc, key = _cluster(run), _index_key(run)
    master = rc.master_for(key)
    first, second = run.halves()
    running = run.batch(first)
    running.wait_until(lambda: running.under_way(1), "every stream to be under way")
    pid = master.pid
    at = FREEZER.freeze(pid)
    run.progress(f"froze the index's master (port {master.port}, pid {pid}) for {run.opts.freeze_s} s")
    try:
        waiting = run.batch(second)
        seen = wait_for(lambda: degraded(run.cluster) is True, at, run.opts.freeze_s, every_s=0.05)
        hold(waiting, run.opts.freeze_s, at)
    finally:
        FREEZER.thaw(pid)
        thawed = time.monotonic()
    run.progress("continued the index's master")
    # Asked only now: a question to the frozen master itself would wait out its reply bound.
    failed_over = _index_master_port(rc, key) not in (None, master.port)
    recovered = wait_for(lambda: degraded(run.cluster) is False, thawed, 30.0, every_s=0.1)
    logs = running.join() + waiting.join()
    return Outcome(logs, at, {"hung_s": round(thawed - at, 3), "recovered_s": recovered, "failed_over": failed_over,
                              "master_port": master.port}, detect_s=seen, own_detect=True)


def redis_failover(run: Run) -> Outcome:
    """The index's master dies (SIGKILL) while the first half of the streams runs; the second
    half is sent meanwhile. Its replica must be promoted (``promoted_s``), the router must stop
    saying ``degraded`` (``recovered_s``) and every node be registered on the new master
    (``reregistered_s``). The killed master is not started again: the cluster runs on with that
    shard's replica as its master, as after a real host loss."""
    from chaos.cluster import wait_for

    rc, key = _cluster(run), _index_key(run)
    if rc.replicas < 1:
        raise ValueError("redis-failover needs a replica per master (pdserve chaos --redis-cluster N starts one)")
    master = rc.master_for(key)
    cl = run.cluster
    first, second = run.halves()
    running = run.batch(first)
    running.wait_until(lambda: running.under_way(1), "every stream to be under way")
    pid = master.pid
    at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    master.proc.wait(timeout=10)
    run.progress(f"killed the index's master (port {master.port}, pid {pid})")
    waiting = run.batch(second)
    promoted = wait_for(lambda: _index_master_port(rc, key) not in (None, master.port), at, 30.0, every_s=0.1)
    recovered = wait_for(lambda: degraded(cl) is False, at, 30.0, every_s=0.1)
    reregistered = wait_for(lambda: set(cl.registered()) >= set(cl.actors), at, 30.0)
    logs = running.join() + waiting.join()
    return Outcome(logs, at, {"killed_port": master.port, "promoted_s": promoted, "recovered_s": recovered,
                              "reregistered_s": reregistered}, detect_s=promoted, own_detect=True)
