"""A node server in a process of its own, for tests that freeze (SIGSTOP) or kill (SIGKILL) a
real process: ``NodeProcess`` starts ``python -m tests.node_process`` on a tiny model with
``node_engine_config``'s engine (4-token blocks), waits for the address it prints and stops it
(SIGCONT first, then SIGKILL) however the test ends. The child exits when its stdin closes, so a
test run that dies leaves no node behind."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from tests.helpers import REPO


class NodeProcess:
    """``role`` node ``node_id`` on model ``model`` in a child process; ``address`` once started."""

    def __init__(self, role: str, node_id: str, model: str, *, redis_url: str, namespace: str,
                 start_timeout_s: float = 60.0) -> None:
        env = {**os.environ, "PDSERVE_TEST_REDIS_URL": redis_url}  # the password stays off the command line
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.node_process", role, node_id, model, namespace],
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        deadline = time.monotonic() + start_timeout_s
        line = ""
        while time.monotonic() < deadline and not line.startswith("address "):
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"node process {node_id} exited with {self.proc.returncode}")
        if not line.startswith("address "):
            self.stop()
            raise RuntimeError(f"node process {node_id} did not start within {start_timeout_s} s")
        self.address = line.split()[1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)  # a frozen child must not outlive the test
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("role", "node_id", "model", "namespace"):
        p.add_argument(name)
    a = p.parse_args()
    from tests.clusters import start_node
    from tests.helpers import node_engine_config

    server = start_node(a.role, a.node_id, node_engine_config(a.model), redis_url=os.environ["PDSERVE_TEST_REDIS_URL"],
                        namespace=a.namespace, lease_s=1.0, heartbeat_s=0.1)
    print(f"address {server.address}", flush=True)
    sys.stdin.read()  # until the parent closes it (or dies)
    server.stop(grace_s=0)


if __name__ == "__main__":
    main()
