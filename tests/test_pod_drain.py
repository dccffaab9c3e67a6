"""The worker preStop hook's process search (deploy/pod_drain.py) on a /proc-shaped directory,
and its drain on real child processes. The hook against a real node actor is in
tests/test_lifecycle.py (test_pod_prestop_drains_the_node_actor_below_it)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from deploy.pod_drain import drain, is_node_actor, node_actor_pids, process_table


def fake_proc(root: Path, procs: dict[int, tuple[int, str, str]]) -> Path:
    """pid -> (ppid, comm, argv[0] title) as /proc/<pid>/{stat,cmdline}."""
    for pid, (ppid, comm, title) in procs.items():
        d = root / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560")
        (d / "cmdline").write_bytes(title.encode() + b"\0" + b"\0" * 8)
    (root / "self").mkdir()  # not a pid: skipped
    return root


def test_finds_node_actors_by_title_below_an_ancestor(tmp_path):
    proc = fake_proc(tmp_path, {
        1: (0, "bash", "/bin/bash"),
        10: (1, "raylet", "/opt/ray/raylet"),
        11: (10, "ray::NodeActor", "ray::NodeActor"),
        12: (10, "ray::NodeActor", "ray::NodeActor.stats"),  # running a method
        13: (10, "ray::IDLE", "ray::IDLE"),
        14: (10, "ray::NodeActorX", "ray::NodeActorX"),  # another class, not ours
        20: (0, "weird) (name", "ray::NodeActor"),  # a comm with parentheses and spaces
    })
    table = process_table(proc)
    assert table[20] == (0, "ray::NodeActor")
    assert node_actor_pids(table) == [11, 12, 20]
    assert node_actor_pids(table, under=10) == [11, 12]
    assert node_actor_pids(table, under=13) == []
    assert is_node_actor("ray::NodeActor") and not is_node_actor("ray::NodeActorX") and not is_node_actor("")


def test_drain_signals_and_waits_until_they_exit():
    """Each gets SIGTERM; one that ignores it is still running at the timeout and reported."""
    quits = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stays = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert stays.stdout.readline().strip() == "ready"  # its handler is set
        lines: list[str] = []
        # (The one that quits stays a zombie of this test until reaped, so it may be listed too.)
        left = drain([quits.pid, stays.pid], 1.0, log=lines.append, poll_s=0.05)
        quits.wait(10)
        assert quits.returncode == -15
        assert stays.pid in left and stays.poll() is None
        assert len(lines) == 2
    finally:
        quits.kill()
        stays.kill()
        quits.wait()
        stays.wait()
