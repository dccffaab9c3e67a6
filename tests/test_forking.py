"""Starting Ray's processes from a process that uses gRPC must not abort them.

ray.init forks with a Python preexec_fn; with gRPC's fork handlers on, a child could die of
SIGABRT before exec, or hang there (deploy/forking.py). The suite runs cluster tests in a process where gRPC
servers and clients have been busy, so this checks the fix in that same setting: many forks
of that kind while gRPC is busy here, none of the children dying.
"""
from __future__ import annotations

import subprocess
import threading
from concurrent import futures

import grpc
import psutil
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

FORKS = 300  # with the handlers on, about 1 in 60 such forks died on the dev VM


def test_forks_with_preexec_fn_survive_busy_grpc():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()

    def hammer():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while not stop.is_set():
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5)

    threads = [threading.Thread(target=hammer, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    codes: list[int] = []
    # A child stuck before exec also blocks Popen itself (it waits for the exec): fork from a
    # thread and give up on it after a while.
    forker = threading.Thread(target=lambda: codes.extend(
        subprocess.Popen(["true"], preexec_fn=lambda: None).wait() for _ in range(FORKS)), daemon=True)
    try:
        forker.start()
        forker.join(timeout=120)
        hung = forker.is_alive()
        if hung:
            for child in psutil.Process().children():
                child.kill()
            forker.join(timeout=30)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        server.stop(0)
    assert not hung, f"a child hung between fork and exec after {len(codes)} forks"
    assert codes == [0] * FORKS, f"{sum(c != 0 for c in codes)} children died (return codes {set(codes)})"
