"""Keep gRPC's fork handlers out of processes that start Ray.

``ray.init`` starts Ray's own processes (GCS, raylet, dashboard, ...) with
``subprocess.Popen(preexec_fn=...)``: a real fork, then Python code, then exec. With gRPC's
fork support on (grpcio's default), the child's post-fork handler restarts gRPC's poller
thread; Popen then closes the inherited descriptors before exec, the poller's epoll_wait fails
with EBADF and gRPC aborts the child (grpc/grpc#43055, grpcio >= 1.81). Ray reports it as
"Failed to start the dashboard, return code -6". It needs gRPC to be busy in the parent, so it
came and went: measured here, 5 of 300 such forks died while a gRPC server and client were
active in the process, 0 of 600 with fork support off.

pdserve never uses gRPC in a forked child (every child execs at once), so the handlers buy
nothing. The setting is read when gRPC initializes: call this before the process first uses
gRPC (the CLI does at start, the test suite in its root conftest).
"""
from __future__ import annotations

import os


def disable_grpc_fork_support() -> None:
    """Turn gRPC's fork handlers off for this process and its children, unless the operator
    set GRPC_ENABLE_FORK_SUPPORT explicitly."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
