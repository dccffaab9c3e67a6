"""deploy/ray_hosts.py's process tree on real processes: a tree whose members call setsid (as
Ray's workers do, out of reach of a process-group kill) is found from /proc and SIGKILLed whole,
including a child forked while the kill runs. The live host loss (a raylet joining the cluster's
Ray, a decode node on it, the host killed mid-stream) is chaos's host-loss scenario,
tests/test_chaos.py::test_host_loss."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from deploy.ray_hosts import children_by_parent, kill_tree, process_tree

# A parent with two children in sessions of their own, one of which keeps forking short-lived
# grandchildren: what a raylet with its agents and workers looks like to /proc.
TREE = r"""
import os, subprocess, sys, time
def own_session(code):
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
own_session("import time; time.sleep(60)")
own_session("import subprocess, sys, time\nwhile True:\n    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n    time.sleep(0.2)")
print("up", flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie is dead, only not yet reaped by its parent


def test_a_tree_of_own_sessions_is_found_and_killed_whole():
    root = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 20
        while len(process_tree(root.pid)) < 4 and time.monotonic() < deadline:  # root, 2 children, a grandchild
            time.sleep(0.1)
        tree = process_tree(root.pid)
        assert len(tree) >= 4 and tree[0] == root.pid
        assert root.pid in children_by_parent()[os.getpid()]
        killed = kill_tree(root.pid)
        root.wait(timeout=10)
        assert set(tree) <= set(killed)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in killed) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in killed if _alive(p)]
    finally:
        if root.poll() is None:
            root.kill()
            root.wait()


def test_a_dead_root_has_no_tree():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert process_tree(p.pid) == [] and kill_tree(p.pid) == []
