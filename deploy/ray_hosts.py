"""A second Ray host on this machine: a raylet that joins a running Ray cluster with its own
resources and its own temp dir (``ray start --address ... --block``), and its loss, every process
of it SIGKILLed at once.

    head (this process's ray.init)        joined raylet ("host B")
      GCS, raylet A, node actors            raylet B, its agents, the node actors placed on it
            ^                                  |
            +---- ray start --address GCS -----+   kill(): SIGKILL the whole tree, read from /proc

Why a raylet and not ``ray.cluster_utils.Cluster``: the host is what `pdserve nodes` meets on a
real cluster, a separate ``ray start`` whose processes the head does not own; its loss is the
raylet, its agents and its workers going together, with no goodbye to the GCS. Ray's workers
call ``setsid``, so a process-group kill misses them: the tree is read by parent pid from
/proc, each pass killing what the last one found until nothing is left.

Its own temp dir matters: a ``ray start`` without one writes ``/tmp/ray/ray_current_cluster``,
and every later bare ``ray.init()`` on the machine then tries to join that cluster.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path


def children_by_parent() -> dict[int, list[int]]:
    """Every live process's children, from /proc (Linux)."""
    out: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # it exited while we looked
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and every descendant of it alive now (parents before children)."""
    kids = children_by_parent()
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        todo.extend(kids.get(pid, ()))
    return [p for p in seen if Path(f"/proc/{p}").exists()]


def kill_tree(root: int, max_passes: int = 20) -> list[int]:
    """SIGKILL ``root`` and all its descendants at once; returns every pid killed.

    The tree is first stopped (SIGSTOP), pass by pass, until a read of it finds nothing new: a
    stopped process forks no more children, and a child forked before its parent stopped shows
    up under that parent in the next read. Then all of it is killed. Killing as it is read
    would miss children forked meanwhile: once their parent dies they belong to init, out of
    the tree."""
    stopped: list[int] = []
    for _ in range(max_passes):
        new = [p for p in process_tree(root) if p not in stopped]
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped.extend(new)
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    return stopped


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it exited meanwhile
        pass


class JoinedRaylet:
    """One extra Ray node on this machine; a context manager. ``resources``: its custom resources
    (``{"decode_pool": 1}`` makes it a decode host; a name of its own pins actors to it)."""

    def __init__(self, gcs_address: str, node_ip: str, resources: Mapping[str, float], num_cpus: int = 1,
                 ray_bin: str | None = None) -> None:
        self.gcs_address = gcs_address
        self.node_ip = node_ip
        self.resources = dict(resources)
        self.num_cpus = num_cpus
        self.ray_bin = ray_bin or str(Path(sys.executable).with_name("ray"))
        self.temp_dir: str | None = None
        self.proc: subprocess.Popen | None = None
        self.node_id: str | None = None  # Ray's node id, once it joined
        self.killed: list[int] = []

    def start(self, timeout_s: float = 60.0) -> "JoinedRaylet":
        """``ray start --address`` and wait until the GCS lists the node alive."""
        import ray

        before = {n["NodeID"] for n in ray.nodes()}
        # Short: Ray puts unix sockets under it (108-byte limit on their paths).
        self.temp_dir = tempfile.mkdtemp(prefix="pdh-", dir="/tmp")
        cmd = [self.ray_bin, "start", "--address", self.gcs_address, "--node-ip-address", self.node_ip,
               "--num-cpus", str(self.num_cpus), "--resources", json.dumps(self.resources),
               "--temp-dir", self.temp_dir, "--block", "--disable-usage-stats", "--include-log-monitor", "false"]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            new = [n for n in ray.nodes() if n["NodeID"] not in before and n["Alive"]
                   and all(n["Resources"].get(k, 0) >= v for k, v in self.resources.items())]
            if new:
                self.node_id = new[0]["NodeID"]
                return self
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace")[-2000:] if self.proc.stderr else ""
                self.cleanup()
                raise RuntimeError(f"ray start --address {self.gcs_address} exited {self.proc.returncode}: {err}")
            time.sleep(0.25)
        self.cleanup()
        raise TimeoutError(f"the raylet did not join {self.gcs_address} within {timeout_s} s")

    def pids(self) -> list[int]:
        """Every process of this host alive now: ``ray start``, the raylet, agents, workers."""
        return process_tree(self.proc.pid) if self.proc is not None and self.proc.poll() is None else []

    def kill(self) -> float:
        """The host's loss: every process of it SIGKILLed at once; monotonic time of the kill."""
        if self.proc is None:
            raise RuntimeError("the raylet was not started")
        at = time.monotonic()
        self.killed = kill_tree(self.proc.pid)
        self.proc.wait(timeout=10)
        return at

    def alive_in_gcs(self) -> bool:
        import ray

        return any(n["NodeID"] == self.node_id and n["Alive"] for n in ray.nodes())

    def cleanup(self) -> None:
        """Kill what is left (a no-op after ``kill``) and remove the temp dir."""
        if self.proc is not None and self.proc.poll() is None:
            self.killed += kill_tree(self.proc.pid)
            self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

    def __enter__(self) -> "JoinedRaylet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()


def head_address() -> tuple[str, str]:
    """(GCS address, node IP) of the Ray cluster this process is connected to."""
    import ray

    return ray.get_runtime_context().gcs_address, ray.util.get_node_ip_address()
