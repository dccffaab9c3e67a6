"""Each fault as one call that injects it into a ChaosCluster and returns how to undo it: the
scenarios (chaos/scenarios.py) inject one on the node serving the most streams, the
nemesis (chaos/nemesis.py) one at a time on a node drawn at random.

    injected = INJECTORS["freeze-decode"](cluster, victim)   # victim None: drawn at random
    ...                                                      # the fault holds
    injected.heal()                                          # SIGCONT, proxy forwarding, ...

``heal`` undoes what the fault did and, where the fault ends a process (a kill, a node that
turned itself unhealthy), waits (bounded) for Ray's restart to register again.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from chaos import faults
from chaos.faults import FREEZER

RESTART_TIMEOUT_S = 120.0


@dataclass(slots=True)
class Injected:
    fault: str
    victim: str | None
    at: float  # monotonic time of the fault
    undo: Callable[[], None] = lambda: None
    healed_at: float | None = None
    info: dict = field(default_factory=dict)

    def heal(self) -> float:
        if self.healed_at is None:
            try:
                self.undo()
            finally:
                self.healed_at = time.monotonic()
        return self.healed_at


def pick(cluster, role: str, victim: str | None, rng: random.Random | None) -> str:
    names = sorted(cluster.role_actors(role))
    if not names:
        raise ValueError(f"this fault needs a {role} node")
    if victim is not None:
        return victim
    return (rng or random).choice(names)


def busiest(cluster, role: str) -> str:
    """The node of ``role`` with the most running sequences (asked before a fault)."""
    actors = cluster.role_actors(role)
    return max(sorted(actors), key=lambda nid: faults.actor_stats(actors[nid]).get("running", 0))


def _new_life(cluster, nid: str, old_pid: int | None, since: float, timeout_s: float) -> float | None:
    """Seconds from ``since`` until ``nid`` runs in a process other than ``old_pid`` and is
    registered (None: not within ``timeout_s``; 0 = do not wait)."""
    import ray

    actor = cluster.actors[nid]
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = ray.get(actor.stats.remote(), timeout=max(0.5, min(5.0, deadline - time.monotonic())))["pid"]
        except Exception:  # noqa: BLE001 - restarting: the actor answers nothing yet
            pid = old_pid
        if pid != old_pid and nid in cluster.registered():
            return round(time.monotonic() - since, 3)
        time.sleep(0.2)
    return None


def _rejoined(cluster, nid: str, since: float, timeout_s: float) -> float | None:
    from chaos.cluster import wait_for

    return wait_for(lambda: nid in cluster.registered(), since, timeout_s)


def freeze_node(role: str):
    def inject(cluster, victim=None, rng=None, restart_timeout_s=RESTART_TIMEOUT_S) -> Injected:
        nid = pick(cluster, role, victim, rng)
        pid = faults.actor_pid(cluster.actors[nid])
        at = FREEZER.freeze(pid)
        inj = Injected(f"freeze-{role}", nid, at, info={"pid": pid})

        def undo() -> None:
            FREEZER.thaw(pid)
            # Awake, it heartbeats again: registered once more (its lease had lapsed).
            inj.info["rejoined_s"] = _rejoined(cluster, nid, time.monotonic(), 30.0)

        inj.undo = undo
        return inj
    return inject


def kill_node(role: str):
    def inject(cluster, victim=None, rng=None, restart_timeout_s=RESTART_TIMEOUT_S) -> Injected:
        nid = pick(cluster, role, victim, rng)
        pid = faults.actor_pid(cluster.actors[nid])
        at = faults.kill_actor(cluster.actors[nid])
        inj = Injected(f"kill-{role}", nid, at, info={"pid": pid})
        inj.undo = lambda: inj.info.__setitem__("restart_s", _new_life(cluster, nid, pid, at, restart_timeout_s))
        return inj
    return inject


def partition(cluster, victim=None, rng=None, restart_timeout_s=RESTART_TIMEOUT_S) -> Injected:
    """The router's link to a decode node stops forwarding (its proxy goes silent)."""
    if not cluster.proxies:
        raise ValueError("partition needs the decode nodes behind their proxies")
    nid = pick(cluster, "decode", victim, rng)
    proxy = cluster.proxies[nid]
    at = time.monotonic()
    proxy.silence()
    return Injected("partition", nid, at, proxy.resume)


def redis_hang(cluster, victim=None, rng=None, restart_timeout_s=RESTART_TIMEOUT_S) -> Injected:
    if cluster.redis is None or cluster.redis.proc is None:
        raise ValueError("redis-hang needs the cluster's own redis-server (not --redis-url)")
    pid = cluster.redis.proc.pid
    at = FREEZER.freeze(pid)
    return Injected("redis-hang", "redis", at, lambda: FREEZER.thaw(pid), info={"pid": pid})


def step_error(cluster, victim=None, rng=None, restart_timeout_s=RESTART_TIMEOUT_S, steps: int = -1) -> Injected:
    """The decode node's engine steps raise (every one, by default, until healed): its requests
    fail with INTERNAL and move; after ``max_step_failures`` in a row the node turns itself
    unhealthy and its actor exits, so Ray starts it again (without the fault)."""
    nid = pick(cluster, "decode", victim, rng)
    actor = cluster.actors[nid]
    pid = faults.actor_pid(actor)
    at = time.monotonic()
    faults.set_step_fault(actor, steps)
    inj = Injected("step-error", nid, at, info={"pid": pid})

    def undo() -> None:
        try:
            faults.set_step_fault(actor, 0, timeout_s=10.0)  # the same life, or a fresh one (a no-op)
        except Exception:  # noqa: BLE001 - restarting: the new life has no fault anyway
            pass
        inj.info["rejoined_s"] = _rejoined(cluster, nid, time.monotonic(), restart_timeout_s)
        try:  # whether it turned unhealthy and Ray started a new process
            inj.info["restarted"] = faults.actor_pid(actor, timeout_s=10.0) != pid
        except Exception:  # noqa: BLE001 - still restarting
            inj.info["restarted"] = True

    inj.undo = undo
    return inj


def corrupt_kv(cluster, victim=None, rng=None, restart_timeout_s=RESTART_TIMEOUT_S) -> Injected:
    """Every prefill node damages each KV transfer after its checksum, on every transport."""
    actors = list(cluster.role_actors("prefill").values())
    if not actors:
        raise ValueError("corrupt-kv needs a prefill node")
    at = time.monotonic()
    faults.set_kv_fault(actors, "flip")
    return Injected("corrupt-kv", "prefill", at, lambda: faults.set_kv_fault(actors, None))


def slow_node(cluster, victim=None, rng=None, restart_timeout_s=RESTART_TIMEOUT_S, seconds: float = 0.2) -> Injected:
    nid = pick(cluster, "decode", victim, rng)
    actor = cluster.actors[nid]
    at = time.monotonic()
    faults.set_step_delay([actor], seconds)
    return Injected("slow-node", nid, at, lambda: faults.set_step_delay([actor], 0.0))


def restart_router(cluster, victim=None, rng=None, restart_timeout_s=RESTART_TIMEOUT_S) -> Injected:
    """SIGKILL the router process (needs ``cluster.router_process()``); heal starts it again."""
    if cluster.router_proc is None:
        raise ValueError("restart-router needs the router running as its own process")
    at = cluster.router_proc.kill()
    return Injected("restart-router", "router", at, cluster.restart_router_process)


INJECTORS: dict[str, Callable[..., Injected]] = {
    "freeze-decode": freeze_node("decode"), "freeze-prefill": freeze_node("prefill"),
    "kill-decode": kill_node("decode"), "kill-prefill": kill_node("prefill"),
    "partition": partition, "redis-hang": redis_hang, "step-error": step_error, "corrupt-kv": corrupt_kv,
    "slow-node": slow_node, "restart-router": restart_router,
}
