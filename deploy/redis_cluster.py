"""Start and stop a private Redis Cluster on loopback: ``masters`` masters and ``replicas``
replicas of each, every one a deploy/redis_server.py ``RedisServer`` with ``cluster-enabled``.

`pdserve up --redis-cluster N` and the tests use this. The cluster is built with plain cluster
commands, not ``redis-cli --cluster create`` (which wants 3 masters at least and the password
on its command line): each master takes an even share of the 16,384 slots and a config epoch of
its own, node 0 meets the others, each replica follows its master, and ``start`` returns once
every node reports ``cluster_state:ok`` and every replica's link to its master is up.

``cluster-node-timeout`` (``node_timeout_ms``) is how long a master may be silent before the
others fail it over to its replica: short here (loopback, and the fault tests kill masters);
``cluster-require-full-coverage no`` keeps the other masters' slots served meanwhile. Clients
connect with ``url`` (``redis+cluster://``: kv_index/client.py); one password for all nodes
(``masterauth`` too, for the replicas).
"""
from __future__ import annotations

import time

import redis

from deploy.redis_server import MAXMEMORY_MIB, RedisServer, _conf_escape, free_port

SLOTS = 16384
BUS_OFFSET = 10000  # a node's cluster bus listens on its port + 10000: both must be free, <= 65535


def cluster_port(host: str) -> int:
    """A free port whose cluster bus port is free too."""
    import socket

    for _ in range(200):
        port = free_port(host)
        if port + BUS_OFFSET > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port + BUS_OFFSET))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) for a Redis Cluster node")


class RedisClusterServer:
    """A local Redis Cluster; use as a context manager. ``nodes``: masters first, then replicas
    (replica ``j`` of master ``i`` at ``masters + i * replicas + j``)."""

    def __init__(self, masters: int = 3, replicas: int = 1, host: str = "127.0.0.1", password: str | None = None,
                 node_timeout_ms: int = 1000, maxmemory_mib: int = MAXMEMORY_MIB) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError(f"a Redis Cluster needs >= 1 master and >= 0 replicas each, got {masters}, {replicas}")
        self.masters, self.replicas, self.host = masters, replicas, host
        first = RedisServer(host=host, password=password, maxmemory_mib=maxmemory_mib, port=cluster_port(host))
        self.password = first.password
        conf = ("cluster-enabled yes", "cluster-config-file nodes.conf", f"cluster-node-timeout {node_timeout_ms}",
                "cluster-require-full-coverage no", "cluster-allow-reads-when-down yes")
        if self.password:
            conf += (f'masterauth "{_conf_escape(self.password)}"',)
        self.nodes = [RedisServer(host=host, password=self.password, maxmemory_mib=maxmemory_mib, extra_conf=conf,
                                  port=cluster_port(host)) for _ in range(masters * (1 + replicas))]

    @property
    def url(self) -> str:
        """``redis+cluster://`` at the first running node (the client finds the others)."""
        plain = next((n for n in self.nodes if n.pid is not None), self.nodes[0]).url
        return "redis+cluster://" + plain.split("://", 1)[1].rsplit("/", 1)[0]

    def admin(self, node: RedisServer) -> redis.Redis:
        return redis.Redis(host=node.host, port=node.port, password=node.password or None, socket_timeout=5.0,
                           socket_connect_timeout=2.0)

    def start(self, timeout: float = 30.0) -> "RedisClusterServer":
        try:
            for n in self.nodes:
                n.start()
            self._form(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self, timeout: float) -> None:
        clients = [self.admin(n) for n in self.nodes]
        try:
            m = self.masters
            for i in range(m):
                clients[i].execute_command("CLUSTER", "ADDSLOTS", *range(i * SLOTS // m, (i + 1) * SLOTS // m))
                clients[i].execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            ids = [c.execute_command("CLUSTER", "MYID") for c in clients]
            ids = [x.decode() if isinstance(x, bytes) else x for x in ids]
            for n in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", n.host, n.port)
            # Known by id, past the handshake (a node in handshake shows a random id of its own).
            self._until(lambda: all(_knows(c, ids) for c in clients), timeout, "the nodes to meet")
            for i in range(m):
                for j in range(self.replicas):
                    clients[m + i * self.replicas + j].execute_command("CLUSTER", "REPLICATE", ids[i])
            self._until(lambda: all(_state_ok(c) for c in clients) and all(
                _link_up(c) for c in clients[m:]), timeout, "cluster_state:ok and every replica in sync")
        finally:
            for c in clients:
                c.close()

    @staticmethod
    def _until(check, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"Redis Cluster: waited {timeout}s for {what}")
            time.sleep(0.1)

    def master_for(self, key: str) -> RedisServer:
        """The node serving ``key``'s slot now (after a failover: the promoted replica)."""
        for n in self.nodes:
            if n.pid is None:
                continue
            c = self.admin(n)
            try:
                slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
                for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        port = int(master[1])
                        return next(x for x in self.nodes if x.port == port)
            except redis.RedisError:
                continue
            finally:
                c.close()
        raise RuntimeError(f"no live node serves the slot of {key!r}")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> "RedisClusterServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _info(c: redis.Redis, section: str) -> dict:
    try:
        return c.info(section)
    except redis.RedisError:
        return {}


def _knows(c: redis.Redis, ids: list[str]) -> bool:
    try:
        text = c.execute_command("CLUSTER", "NODES")
    except redis.RedisError:
        return False
    text = text.decode() if isinstance(text, bytes) else text
    known = {line.split()[0] for line in text.strip().splitlines() if "handshake" not in line and "noaddr" not in line}
    return set(ids) <= known


def _state_ok(c: redis.Redis) -> bool:
    try:
        text = c.execute_command("CLUSTER", "INFO")
        text = text.decode() if isinstance(text, bytes) else text
        return "cluster_state:ok" in text
    except redis.RedisError:
        return False


def _link_up(c: redis.Redis) -> bool:
    info = _info(c, "replication")
    return info.get("role") == "slave" and info.get("master_link_status") == "up"


if __name__ == "__main__":  # manual use: python -m deploy.redis_cluster [masters]
    import os
    import sys

    with RedisClusterServer(int(sys.argv[1]) if len(sys.argv) > 1 else 3) as rc:
        print(rc.url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    os._exit(0)
