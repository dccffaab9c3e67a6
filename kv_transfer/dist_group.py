"""Two-rank torch.distributed process groups beside a data connection, and where they meet.

The ``dist`` transport (dist_transport.py) moves a transfer's payload over a process group
made for one kept data connection (receiver.py's TcpKVServer, the decode node's data port);
the connection still carries the frames (header, chunk checksums, trailer, reply). Making one:

    sender -> frame(KVBlockMessage dist_attach: request_id, token)   on the data connection
    receiver checks the reservation's token (HeaderGate.authenticate), draws a random key,
    sender <- frame(KVStreamReply dist: store_port, group_key, timeout_ms)
    both:     ProcessGroupGloo(SealedStore(TCPStore(host, store_port), group_key), rank, 2)
              receiver rank 0 (its ``DistRendezvous`` runs the TCPStore), sender rank 1

so only a peer that holds a live reservation's token learns a key, and a key serves one group
(vLLM's stateless process group for its NCCL communicator works the same way). The TCPStore
has no authentication and anyone who reaches it can list and read its keys, so the key is
never written into it: ``SealedStore`` names every entry by an HMAC of its name under the key
and seals every value (encrypted and authenticated), so a stranger on the store port learns
neither the key nor the gloo addresses, and a value it wrote fails the group's set-up instead
of pointing a rank at the stranger. Each store listens only on the interface the data
connection arrived on (loopback for a peer on loopback; its socket is bound here and handed
to TCPStore, whose own listener takes every interface), and a group's entries are deleted
once it formed.
Every operation on a group, its set-up included, is bounded by the timeout the receiver
named; a group that timed out or failed is aborted with its connection, never reused.

The backend is gloo: the CPU build has no NCCL (docs/environment.md). On CUDA pools the
payload is staged on the host (as shm does); an NCCL group is the same code with another
backend and device staging, not built here.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import select
import socket
import threading
import time
import weakref
from datetime import timedelta

import grpc
import numpy as np
import torch
from torch.distributed import ProcessGroupGloo, Store, TCPStore

from kv_transfer.data_port import frame, send_all
from kv_transfer.validate import HeaderGate, KVValidationError, status_code
from protos.pdserve.v1 import kv_pb2

log = logging.getLogger(__name__)

# Every wait on a group (set-up, a send, a receive). A healthy peer posts its side of a chunk
# within milliseconds; this is tcp_transport's progress timeout, for the same reason: a
# frozen peer holds a push, its blocks and the reservation this long, not the push's deadline.
GROUP_TIMEOUT_S = 5.0
# The receiver's wait for a sender to join a group it was offered. Groups form one at a time in
# a process (measured: a join waiting on an absent peer held another pair's join back for the
# whole wait), so a sender that asked and went away must not hold the others back for long;
# a group forms in ~10 ms on a busy 2-core machine.
JOIN_TIMEOUT_S = 2.0
RECEIVER_RANK, SENDER_RANK = 0, 1
_TAG = 0  # one stream of sends per group, in order
_NONCE, _MAC = 16, 32  # bytes of a sealed value's nonce and tag


class SealedStore(Store):
    """``inner`` (a TCPStore anyone on its port may read and write) as seen through ``key``:
    the names gloo uses become HMAC-SHA256(key, name), its values are XORed with a
    SHAKE-256(key, fresh nonce) keystream and tagged with HMAC-SHA256 over (name, nonce,
    ciphertext). A value that fails its tag raises RuntimeError, which fails the group's
    set-up (a stranger can break a group it found, not join or redirect it). Only what gloo's
    rendezvous calls is implemented: set, get, wait, check, delete_key."""

    def __init__(self, inner: Store, key: str) -> None:
        super().__init__()
        root = hashlib.sha256(b"pdserve-kv-store\0" + key.encode()).digest()
        self._k_name, self._k_enc, self._k_mac = (hmac.digest(root, label, "sha256")
                                                  for label in (b"name", b"enc", b"mac"))
        self._inner = inner
        self.touched: set[str] = set()  # inner names this side wrote or read (``forget``)

    def name(self, key: str) -> str:
        return "pdserve-kv/" + hmac.digest(self._k_name, key.encode(), "sha256").hex()

    def seal(self, key: str, value: bytes) -> bytes:
        nonce = secrets.token_bytes(_NONCE)
        body = _xor(value, hashlib.shake_256(self._k_enc + nonce).digest(len(value)))
        return nonce + body + hmac.digest(self._k_mac, self.name(key).encode() + nonce + body, "sha256")

    def open(self, key: str, sealed: bytes) -> bytes:
        nonce, body, tag = sealed[:_NONCE], sealed[_NONCE:-_MAC], sealed[-_MAC:]
        want = hmac.digest(self._k_mac, self.name(key).encode() + nonce + body, "sha256")
        if len(sealed) < _NONCE + _MAC or not hmac.compare_digest(tag, want):
            raise RuntimeError(f"rendezvous store: the value of {key!r} is not this group's (written by a stranger)")
        return _xor(body, hashlib.shake_256(self._k_enc + nonce).digest(len(body)))

    def set(self, key: str, value) -> None:
        name = self.name(key)
        self.touched.add(name)
        self._inner.set(name, self.seal(key, bytes(value)))

    def get(self, key: str) -> bytes:
        name = self.name(key)
        self.touched.add(name)
        return self.open(key, self._inner.get(name))

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        names = [self.name(k) for k in keys]
        self._inner.wait(names) if timeout is None else self._inner.wait(names, timeout)

    def check(self, keys) -> bool:
        return self._inner.check([self.name(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(self.name(key))

    def forget(self) -> None:
        """Delete every entry this side touched, once nobody reads them (best effort: a store
        already stopped has nothing left to delete)."""
        names, self.touched = self.touched, set()
        for name in names:
            try:
                self._inner.delete_key(name)
            except RuntimeError:
                return


def _xor(data: bytes, stream: bytes) -> bytes:
    return (int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")).to_bytes(len(data), "little")


class PairGroup:
    """One side of a two-rank gloo group: ``rank`` of 2, meeting under ``key`` in ``store``
    (through a SealedStore: the key itself is never written there).
    The constructor blocks until the peer joined (at most ``join_s``, default ``timeout_s``;
    RuntimeError then). ``setup_s`` is how long that took. Every later wait takes its own bound
    (``wait``), at most ``timeout_s``."""

    def __init__(self, store: TCPStore, key: str, rank: int, host: str, timeout_s: float,
                 join_s: float | None = None) -> None:
        t0 = time.monotonic()
        self.timeout_s = timeout_s
        opts = ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=timeout_s if join_s is None else join_s)
        # The interface the data connection uses: the peer reaches us where it reached the port.
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        self.store = SealedStore(store, key)
        try:
            self._pg: ProcessGroupGloo | None = ProcessGroupGloo(self.store, rank, 2, opts)
        except BaseException:
            self.store.forget()  # a group that did not form: nobody reads its entries
            raise
        self._peer = 1 - rank
        self.setup_s = time.monotonic() - t0

    def send(self, data: torch.Tensor):
        """Start sending ``data`` ([n] uint8, contiguous, not to be touched until ``wait``);
        ConnectionError if the group is broken or closed."""
        return self._start(self._pg.send if self._pg is not None else None, data)

    def recv(self, out: torch.Tensor):
        """Start receiving the peer's next send into ``out`` ([n] uint8, exactly its size)."""
        return self._start(self._pg.recv if self._pg is not None else None, out)

    def _start(self, op, tensor: torch.Tensor):
        if op is None:
            raise ConnectionError("process group closed")
        try:
            return op([tensor], self._peer, _TAG)
        except RuntimeError as err:  # gloo: the peer closed (died, or aborted its side)
            raise ConnectionError(f"process group failed: {err}") from None

    def wait(self, work, wait_s: float | None = None) -> None:
        """Wait for ``work`` (a send or receive of this group) at most ``wait_s`` seconds
        (default: the group's timeout): TimeoutError then, ConnectionError if the group broke."""
        wait_s = self.timeout_s if wait_s is None else min(wait_s, self.timeout_s)
        try:
            work.wait(timedelta(seconds=max(0.001, wait_s)))
        except RuntimeError as err:  # gloo raises RuntimeError (DistBackendError) for both
            if "timed out" in str(err).lower():
                raise TimeoutError(f"process group: no progress for {wait_s:.3g} s") from None
            raise ConnectionError(f"process group failed: {err}") from None

    def close(self) -> None:
        """Abort the group (pending operations fail at once); idempotent."""
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.abort()


class GroupInbox:
    """The receiver's side of a connection's group: chunks into two staging buffers, the next
    chunk's receive posted before this one is checked and scattered. A gloo send that finds its
    receive posted moves several times faster than one that arrives first (measured: 327 KB in
    0.25 ms against 2.3 ms on loopback), so the sender must not get ahead of the receiver."""

    def __init__(self, group: PairGroup, chunk_bytes: int) -> None:
        self.group = group
        self._chunk_bytes = chunk_bytes  # the sender's (KVDistAttach.chunk_bytes)
        self._bufs: list[torch.Tensor | None] = [None, None]  # [capacity] uint8 each
        self._slot = 0
        self._posted: tuple[object, int, int] | None = None  # (work, bytes, slot) posted ahead

    def expect(self, payload_bytes: int, unit: int) -> None:
        """Post the receive of a validated transfer's first chunk (``unit``: bytes per block-layer)."""
        if self._posted is None and payload_bytes:
            n = min(payload_bytes, max(1, self._chunk_bytes // unit) * unit)
            self._posted = (self.group.recv(self._buf(self._slot, n)), n, self._slot)

    def take(self, n: int, next_n: int) -> np.ndarray:
        """The next ``n`` bytes sent over the group ([n] uint8, valid until the call after
        next); ``next_n`` > 0: post the receive of the next chunk, that many bytes, now."""
        if self._posted is not None:
            work, posted_n, slot = self._posted
            self._posted = None
            if posted_n != n:  # the sender broke the one-size rule: the group is out of step
                raise ConnectionError(f"chunk of {n} bytes where {posted_n} were posted")
        else:
            slot = self._slot
            work = self.group.recv(self._buf(slot, n))
        self.group.wait(work)
        # A chunk arrived, so the sender's group is built and read both entries: drop them
        # from the store (a group that never moves a chunk drops them at close).
        self.group.store.forget()
        if next_n > 0:
            other = 1 - slot
            self._posted = (self.group.recv(self._buf(other, next_n)), next_n, other)
        self._slot = 1 - slot
        return self._bufs[slot][:n].numpy()

    def _buf(self, slot: int, n: int) -> torch.Tensor:
        buf = self._bufs[slot]
        if buf is None or buf.numel() < n:
            buf = self._bufs[slot] = torch.empty(n, dtype=torch.uint8)
        return buf[:n]

    def close(self) -> None:
        self.group.store.forget()
        self.group.close()


def sender_group(host: str, ready, local_host: str) -> PairGroup:
    """The sender's side of the group a receiver at ``host`` offered (``ready``: KVDistReady);
    ``local_host``: this end's address of the data connection."""
    timeout_s = ready.timeout_ms / 1000
    store = TCPStore(host, ready.store_port, None, False, timedelta(seconds=timeout_s))
    return PairGroup(store, ready.group_key, SENDER_RANK, local_host, timeout_s)


class DistRendezvous:
    """The receiver's meeting points for groups: a TCPStore server per local interface a data
    connection arrived on (port 0: a free one), started on first use, and a fresh key per
    group. ``host`` is the data port's bind address, the interface used when none is named."""

    def __init__(self, host: str, timeout_s: float = GROUP_TIMEOUT_S) -> None:
        self._host = host
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # connections ask for keys from their own threads
        self._stores: dict[str, tuple[int, TCPStore]] = {}  # local address -> (port, store)
        # Groups still open (their connections hold them), aborted on close.
        self._groups: weakref.WeakSet[PairGroup] = weakref.WeakSet()
        self.groups_made = 0
        self.setup_s_total = 0.0  # summed over the groups made (metrics: amortized set-up)

    def offer(self, local_host: str | None = None) -> tuple[int, str]:
        """(store port, a new group key) for one group on interface ``local_host``."""
        with self._lock:
            return self._store(local_host)[0], f"pdserve-kv-{secrets.token_hex(16)}"

    def _store(self, local_host: str | None) -> tuple[int, TCPStore]:
        host = _plain_address(local_host or self._host)
        if host not in self._stores:
            # Bound here so the store listens on this interface only (TCPStore's own listener
            # takes every one: a data port on 0.0.0.0 would expose it to every network for a
            # peer on loopback); the store owns the socket from here on.
            listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
            port = listener.getsockname()[1]
            self._stores[host] = port, TCPStore(host, port, None, True, timedelta(seconds=self.timeout_s),
                                                wait_for_workers=False, master_listen_fd=listener.detach())
        return self._stores[host]

    def port(self, local_host: str | None = None) -> int | None:
        """The store port on ``local_host``, if one was started there."""
        entry = self._stores.get(_plain_address(local_host or self._host))
        return None if entry is None else entry[0]

    def join(self, key: str, local_host: str) -> PairGroup:
        """The receiver's side of the group under ``key`` (after the sender was told it)."""
        with self._lock:
            store = self._store(local_host)[1]
        group = PairGroup(store, key, RECEIVER_RANK, local_host, self.timeout_s,
                          join_s=min(self.timeout_s, JOIN_TIMEOUT_S))
        with self._lock:
            self._groups.add(group)
            self.groups_made += 1
            self.setup_s_total += group.setup_s
        return group

    def close(self, wait_s: float = 2.0) -> None:
        """Abort every group, and wait (at most ``wait_s``) for their connection threads to
        drop them: a group freed on a daemon thread while the interpreter exits aborts the
        process ("terminate called without an active exception"). Call after the data
        connections were shut down (TcpKVServer.stop)."""
        with self._lock:
            self._stores.clear()  # a server stops with the last group that holds it
            groups = list(self._groups)
        for group in groups:
            group.close()
        del groups
        deadline = time.monotonic() + wait_s
        while len(self._groups) and time.monotonic() < deadline:
            time.sleep(0.01)


def dist_attach(rendezvous: DistRendezvous | None, gate: HeaderGate, conn, attach: kv_pb2.KVDistAttach,
                max_chunk_bytes: int) -> tuple[kv_pb2.KVStreamReply | None, bool]:
    """The receiver's side of a KVDistAttach on data connection ``conn`` (receiver.py's
    _Connection): refuse a peer without a live reservation's token, else answer with the
    rendezvous and join the group as its rank 0. -> (a reply still to send, or None when it
    was sent; keep the connection)."""
    if rendezvous is None:  # the sender falls back to the next transport
        return _error(grpc.StatusCode.UNAVAILABLE, "dist attach: this data port offers no process groups"), True
    try:
        gate.authenticate(attach.request_id, attach.token)
    except KVValidationError as err:
        return _error(status_code(err), f"dist attach: {err}"), False
    if not 0 < attach.chunk_bytes <= max_chunk_bytes:
        return _error(grpc.StatusCode.INVALID_ARGUMENT,
                      f"dist attach chunk_bytes: got {attach.chunk_bytes}, expected (0, {max_chunk_bytes}]"), False
    conn.prove()
    port, key = rendezvous.offer(conn.sock.getsockname()[0])
    ready = kv_pb2.KVDistReady(store_port=port, group_key=key, timeout_ms=round(rendezvous.timeout_s * 1000))
    send_all(conn.sock, [frame(kv_pb2.KVStreamReply(dist=ready))])
    if _peer_left(conn.sock):  # it gave up waiting for the answer: nobody will join
        return None, False
    if conn.group is not None:
        conn.group.close()
        conn.group = None
    try:
        conn.group = GroupInbox(rendezvous.join(key, conn.sock.getsockname()[0]), attach.chunk_bytes)
    except RuntimeError as err:  # the sender did not join in time: this connection ends
        log.info("KV dist group did not form: %s", err)
        return None, False
    return None, True


def _plain_address(host: str) -> str:
    """An IPv4 address seen through a dual-stack socket ("::ffff:10.0.0.5") as itself."""
    return host[7:] if host.startswith("::ffff:") and "." in host else host


def _peer_left(sock: socket.socket) -> bool:
    """Whether the peer has closed its end already (EOF or a reset pending)."""
    try:
        ready, _, _ = select.select([sock], [], [], 0)
        return bool(ready) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _error(code: grpc.StatusCode, message: str) -> kv_pb2.KVStreamReply:
    return kv_pb2.KVStreamReply(error=kv_pb2.KVStreamError(code=code.value[0], message=message))
