"""The faults chaos injects into real processes, each with its undo.

- Freeze: ``SIGSTOP`` a process (a node actor, redis-server, the router), ``SIGCONT`` it later.
  A stopped process keeps its sockets open and answers nothing: the quiet failure of a wedged
  GPU or a kernel stall. Every freeze is recorded in ``FREEZER``, which thaws whatever is still
  stopped when the run ends (``thaw_all`` in the CLI's and the cluster's ``finally``, and at
  interpreter exit), so no run leaves a frozen process behind.
- Kill: ``ray.kill`` of a node actor (Ray restarts it, as after a crash), ``SIGKILL`` of a pid.
- Engine steps that raise (node/faults.py, reached through the actor's ``set_step_fault``),
  corrupt KV transfers (prefill_node/faults.py, the actor's ``set_kv_fault``), slow steps (the
  actor's ``set_step_delay``): hooks only the node's own process can turn on, over Ray.
- A partition: chaos/proxy.py.

A node actor's pid is what its ``stats()`` says (``os.getpid()`` in the actor); ask before the
freeze, since a frozen actor answers nothing.
"""
from __future__ import annotations

import atexit
import os
import signal
import threading
import time


class Freezer:
    """Stops and continues processes; remembers which are stopped until they are continued."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped: dict[int, float] = {}  # pid -> when it was stopped

    def freeze(self, pid: int) -> float:
        """SIGSTOP ``pid``; returns the monotonic time of the fault."""
        with self._lock:
            self._stopped[pid] = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        return self._stopped[pid]

    def thaw(self, pid: int) -> None:
        with self._lock:
            self._stopped.pop(pid, None)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # it died meanwhile (Ray killed it): nothing to continue
            pass

    def thaw_all(self) -> list[int]:
        with self._lock:
            pids = list(self._stopped)
        for pid in pids:
            self.thaw(pid)
        return pids

    @property
    def stopped(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._stopped)


FREEZER = Freezer()
atexit.register(FREEZER.thaw_all)


def sigkill(pid: int) -> float:
    """SIGKILL ``pid``; returns the monotonic time of the fault."""
    at = time.monotonic()
    FREEZER.thaw(pid)  # a stopped process dies too, but keep the ledger true
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return at


def actor_pid(actor, timeout_s: float = 30.0) -> int:
    import ray

    return int(ray.get(actor.stats.remote(), timeout=timeout_s)["pid"])


def actor_stats(actor, timeout_s: float = 30.0) -> dict:
    import ray

    return ray.get(actor.stats.remote(), timeout=timeout_s)


def kill_actor(actor) -> float:
    """Kill a node actor as a crash would (Ray restarts it); returns the time of the fault."""
    import ray

    at = time.monotonic()
    ray.kill(actor, no_restart=False)
    return at


def set_step_fault(actor, steps: int, timeout_s: float = 30.0) -> None:
    """The next ``steps`` engine steps of the node raise (-1: every one until 0)."""
    import ray

    ray.get(actor.set_step_fault.remote(steps), timeout=timeout_s)


def set_kv_fault(actors, mode: str | None, timeout_s: float = 30.0) -> None:
    import ray

    ray.get([a.set_kv_fault.remote(mode) for a in actors], timeout=timeout_s)


def set_step_delay(actors, seconds: float, timeout_s: float = 30.0) -> None:
    import ray

    ray.get([a.set_step_delay.remote(seconds) for a in actors], timeout=timeout_s)
