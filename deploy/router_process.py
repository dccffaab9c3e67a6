"""The router as its own process, as the Helm chart runs it (``python -m frontend.server ...``): the
extra replicas of `pdserve up --routers N` (on the first one's ports, SO_REUSEPORT), and the router
chaos SIGKILLs with streams in flight and starts again on the same ports.

``router_argv`` maps a RouterConfig onto the flags of ``python -m frontend.server``, generated from
the fields' declarations (``settings.flags.to_argv``; a setting no flag carries is refused, not
dropped); the Redis password goes in ``$PDSERVE_REDIS_PASSWORD``, never on the command line. The process gets SIGTERM if this one
dies (Linux), and its log goes to a file beside nothing else.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from kv_index.redis_url import PASSWORD_ENV
from settings.flags import to_argv

REPO = Path(__file__).resolve().parents[1]
READY_PREFIX = "router listening on "


def split_password(url: str) -> tuple[str, str | None]:
    """``redis://:pw@host:port/0`` -> (``redis://host:port/0``, "pw")."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    user = f"{parts.username}@" if parts.username else ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=user + host)), unquote(parts.password)


def router_argv(cfg, port: int, http_port: int | None) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) of ``python -m frontend.server`` serving as ``cfg`` on the given
    ports (a port taken from a running router: the new process binds the same ones). ValueError:
    ``cfg`` has TLS or API keys, or a setting the flags cannot carry."""
    from router.planner.config import lease_for

    if cfg.tls is not None or cfg.api_keys:
        # Their files and keys would have to reach the process by a way that keeps keys off
        # its command line; not built yet.
        raise ValueError("a router process is started without TLS or API keys (--tls and --api-key are "
                         "not handed to it)")
    if cfg.planner.leader_lease_s != lease_for(cfg.planner.interval_s):
        raise ValueError(f"the router process derives the planner's leader lease from --planner-interval-s: "
                         f"{lease_for(cfg.planner.interval_s)}, not {cfg.planner.leader_lease_s}")
    url, password = split_password(cfg.redis_url)
    argv = [sys.executable, "-m", "frontend.server", "--redis-url", url, "--port", str(port),
            "--http-port", str(-1 if http_port is None else http_port),
            # replica_id: each process names itself (two replicas never share a record).
            *to_argv(cfg, exclude=("redis_url", "port", "http_port", "planner", "replica_id")),
            *to_argv(cfg.planner, exclude=("leader_lease_s",))]
    return argv, ({PASSWORD_ENV: password} if password else {})


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class RouterProcess:
    """One ``python -m frontend.server`` process; ``start`` returns once it listens."""

    def __init__(self, cfg, port: int, http_port: int | None, ready_timeout_s: float = 120.0) -> None:
        self.cfg = cfg
        self.argv, self._env = router_argv(cfg, port, http_port)
        self.address = f"{cfg.host}:{port}"
        self.http_address = f"{cfg.host}:{http_port}" if http_port is not None else None
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log_dir = Path(tempfile.mkdtemp(prefix="pdserve-router-"))
        self.log_path = self._log_dir / "router.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> "RouterProcess":
        env = {**os.environ, **self._env, "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it; closed with the process
        self.proc = subprocess.Popen(self.argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log,
                                     preexec_fn=_die_with_parent)
        log.close()
        ready = threading.Event()

        def read() -> None:  # the ready line, then drain stdout so the child never blocks on it
            for line in self.proc.stdout:
                if line.decode(errors="replace").startswith(READY_PREFIX):
                    ready.set()

        threading.Thread(target=read, name="router-process-stdout", daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the router process did not come up; its log: {self.log_path}:\n"
                                   f"{self.log_tail()}")
        return self

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> float:
        """SIGKILL, as an OOM kill or a node loss does; returns the time of the fault."""
        at = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a frozen router dies as well, but be sure
            self.proc.kill()
            self.proc.wait(10)
        return at

    def terminate(self) -> None:
        """SIGTERM without waiting: the process starts its drain (several drain at once)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (a drain), then SIGKILL if it lingers."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def cleanup(self) -> None:
        self.stop()
        for p in self._log_dir.glob("*"):
            p.unlink(missing_ok=True)
        self._log_dir.rmdir()
