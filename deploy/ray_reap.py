"""Ending a removed node actor's process when ``ray.kill`` does not.

``ray.kill`` asks the actor's raylet to end the worker: the raylet sends the worker a KillActor
RPC and SIGKILLs it when it has not exited 5 s later. A worker frozen before it answered its
raylet (SIGSTOP, a hung start) fails that RPC at connect instead; the raylet then sends nothing,
the GCS calls the actor dead and frees its name, and the process lives on (seen with Ray 2.60
and its dashboard on: tests/test_pool_up.py): it holds its pool unit, so a replacement cannot
be placed, and once it runs again it may go on starting. So the pool controller notes where
the actor runs before the kill (Ray's state API, which needs the dashboard; without one there
is nothing to note and ``ray.kill`` alone ends it) and afterwards SIGKILLs that process on its
node, through a task pinned there.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import NamedTuple

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 5  # the state API's own bound (an int: Ray's parameter)
# Ray SIGKILLs a worker that has not exited 5 s after the kill RPC: its own path goes first.
KILL_GRACE_S = 6.0
REAP_TIMEOUT_S = 15.0  # a task on another node: a worker to start there


class ActorProcess(NamedTuple):
    node_id: str
    pid: int


def actor_process(name: str) -> ActorProcess | None:
    """Where the live actor ``name`` (this driver's namespace) runs; None when it has no
    process yet (pending: no room), when Ray has no state API here, or on any lookup error.
    An actor still in its constructor has a pid but no node in Ray's actor table: the node
    comes from the worker table then (left unknown should two nodes have a worker of that pid)."""
    import ray
    from ray.util.state import list_actors, list_workers

    ctx = ray.get_runtime_context()
    query = dict(address=ctx.gcs_address, timeout=LOOKUP_TIMEOUT_S, raise_on_missing_output=False)
    try:  # the address always: without it Ray picks one of the clusters running on this machine
        found = [a for a in list_actors(
            filters=[("name", "=", name), ("ray_namespace", "=", ctx.namespace),
                     ("state", "!=", "DEAD")], **query) if a.pid]
        if not found:
            return None
        pid, node_id = int(found[0].pid), found[0].node_id
        if not node_id:
            nodes = {w.node_id for w in list_workers(filters=[("pid", "=", pid), ("is_alive", "=", True)], **query)}
            node_id = nodes.pop() if len(nodes) == 1 else None
    except Exception as e:  # no dashboard, or it is slow: ray.kill is all there is
        log.info("where %s runs is unknown (%s); relying on ray.kill", name, e)
        return None
    return ActorProcess(node_id, pid) if node_id else None


def _running(pid: int) -> bytes | None:
    """The title of process ``pid``, or None when it is gone (a zombie waiting to be reaped too)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                return None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def kill_worker(pid: int, grace_s: float = KILL_GRACE_S) -> bool:
    """Wait up to ``grace_s`` for Ray's own kill to end ``pid``, then SIGKILL it if it is still
    a Ray worker ("ray::" in its title; a pid reused by another program is left alone). True:
    it had to be killed here."""
    deadline = time.monotonic() + grace_s
    while (title := _running(pid)) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    if title is None or not title.startswith(b"ray::"):
        return False
    try:
        os.kill(pid, signal.SIGKILL)  # a stopped process dies of it too
    except ProcessLookupError:
        return False
    return True


def reap(name: str, where: ActorProcess) -> None:
    """After ``ray.kill`` of ``name``: make sure its process ends (bounded). On this node
    directly; on another, through a task pinned there."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        if where.node_id == ray.get_runtime_context().get_node_id():
            killed = kill_worker(where.pid)
        else:
            task = ray.remote(kill_worker).options(num_cpus=0, max_retries=0, scheduling_strategy=(
                NodeAffinitySchedulingStrategy(where.node_id, soft=False)))
            killed = ray.get(task.remote(where.pid), timeout=KILL_GRACE_S + REAP_TIMEOUT_S)
        if killed:
            log.warning("%s: its process %d outlived ray.kill (frozen?); SIGKILLed it", name, where.pid)
    except Exception as e:  # the node is gone (and its processes with it), or busy: logged, not fatal
        log.warning("%s: could not make sure its process %d ended: %s", name, where.pid, e)
