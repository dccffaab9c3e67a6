"""`python -m deploy.pod_drain`: drain the node actors running in this pod before it stops
(the Helm chart's worker preStop hook).

Kubernetes sends SIGTERM only to a container's PID 1, which in a KubeRay worker pod is the
shell running `ray start --block`; the node actor is a Ray worker process below the raylet and
never sees it, and once Ray stops, the actor dies with its requests in flight. So this hook,
run before that SIGTERM, sends SIGTERM to each node actor process itself: the actor's handler
drains (refuse new work, report NOT_SERVING, finish in-flight requests within the node's
``--drain-timeout``, leave the index) and exits through its own method, so Ray does not restart
it (node/actor.py). The hook returns once they are gone, or at ``--timeout-s``; the pod then
stops as usual.

A node actor process is found by the title Ray gives an actor's worker process
(``ray::NodeActor``, ``ray::NodeActor.<method>`` while one runs) in /proc; stdlib only, since it
runs in the node image beside Ray. ``--under PID`` limits it to that process's descendants
(default: every process this user can see, which in a pod is the pod's own).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ACTOR_TITLE = "ray::NodeActor"  # node.actor.NodeActor's class name, as Ray titles its process


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # gone meanwhile, or not ours to read
        return b""


def process_table(proc: Path = Path("/proc")) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, title: the first word of its command line)."""
    table = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _read(entry / "stat").decode(errors="replace")
        cmdline = _read(entry / "cmdline").split(b"\0")[0].decode(errors="replace")
        # stat is "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) >= 2 and fields[1].isdigit():
            table[int(entry.name)] = (int(fields[1]), cmdline.split(" ")[0] if cmdline else "")
    return table


def is_node_actor(title: str) -> bool:
    return title == ACTOR_TITLE or title.startswith(ACTOR_TITLE + ".")


def node_actor_pids(table: dict[int, tuple[int, str]], under: int | None = None) -> list[int]:
    """The node actor processes in ``table``; with ``under``, only that process's descendants."""
    def descends(pid: int) -> bool:
        seen = set()
        while pid in table and pid not in seen:
            seen.add(pid)
            pid = table[pid][0]
            if pid == under:
                return True
        return False

    me = os.getpid()
    return sorted(pid for pid, (_, title) in table.items()
                  if pid != me and is_node_actor(title) and (under is None or descends(pid)))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def drain(pids: Iterable[int], timeout_s: float, *, log: Callable[[str], None] = print,
          poll_s: float = 0.2) -> list[int]:
    """SIGTERM each, then wait until all exited or ``timeout_s`` passed; returns those still alive."""
    pending = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            pending.append(pid)
            log(f"pod-drain: SIGTERM to node actor process {pid}")
        except ProcessLookupError:
            pass
        except PermissionError as e:
            log(f"pod-drain: cannot signal {pid}: {e}")
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        time.sleep(poll_s)
        pending = [p for p in pending if alive(p)]
    return pending


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.pod_drain", description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout-s", type=float, required=True,
                   help="wait at most this long for the nodes to finish (the node's --drain-timeout plus a margin)")
    p.add_argument("--under", type=int, default=None, metavar="PID",
                   help="only node actors below this process (default: all this user can see)")
    a = p.parse_args(argv)
    pids = node_actor_pids(process_table(), a.under)
    if not pids:
        print("pod-drain: no node actor running here", flush=True)
        return 0
    left = drain(pids, a.timeout_s, log=lambda m: print(m, flush=True))
    if left:
        print(f"pod-drain: {left} still running after {a.timeout_s:.0f} s; the pod stops them", flush=True)
        return 1
    print(f"pod-drain: {len(pids)} node(s) drained and exited", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
