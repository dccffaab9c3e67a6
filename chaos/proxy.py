"""A loopback TCP proxy that can go silent: the ``partition`` fault.

One decode node is reached through it (the node advertises the proxy's port: NodeConfig's
``advertise_grpc_port``), so the router's link to that node, and any gRPC KV push to it, pass
here. ``silence()`` stops forwarding in both directions without closing a socket, as a
partitioned network does: nothing arrives, nothing is refused, every connection stays open.
The kernel's buffers fill and the senders block; a new connection is accepted and then held
silent too. ``resume()`` forwards again what was held (TCP would retransmit it after a partition
heals); a side that gave up meanwhile has closed its socket, and the proxy then closes the other.

    router --- 127.0.0.1:P (this proxy) ---> 127.0.0.1:Q (decode node's bound gRPC port)

One thread, non-blocking sockets, a selector; loopback only.
"""
from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading

log = logging.getLogger(__name__)
BUFFER_BYTES = 1 << 16


class _Pair:
    __slots__ = ("client", "upstream", "pending")

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.pending: dict[socket.socket, bytearray] = {client: bytearray(), upstream: bytearray()}

    def other(self, sock: socket.socket) -> socket.socket:
        return self.upstream if sock is self.client else self.client


class SilentProxy:
    """Forwards ``127.0.0.1:port`` to ``target`` ("host:port") until ``silence()``."""

    def __init__(self, target: str, port: int = 0, host: str = "127.0.0.1") -> None:
        thost, tport = target.rsplit(":", 1)
        self.target = (thost, int(tport))
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self.address = f"{host}:{self.port}"
        self._sel = selectors.DefaultSelector()
        self._pairs: dict[socket.socket, _Pair] = {}
        self._silent = threading.Event()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self.forwarded_bytes = 0
        self.connections = 0
        self._thread = threading.Thread(target=self._loop, name=f"chaos-proxy-{self.port}", daemon=True)
        self._thread.start()

    @property
    def silent(self) -> bool:
        return self._silent.is_set()

    def silence(self) -> None:
        self._silent.set()
        self._wake()

    def resume(self) -> None:
        self._silent.clear()
        self._wake()

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(5)

    def __enter__(self) -> "SilentProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # ---- the loop
    def _loop(self) -> None:
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._sel.register(self._listener, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                self._rearm()
                for key, mask in self._sel.select(timeout=0.5):
                    sock = key.fileobj
                    if sock is self._wake_r:
                        self._drain_wake()
                    elif sock is self._listener:
                        self._accept()
                    elif sock in self._pairs:
                        self._service(sock, mask)
        finally:
            for sock in list(self._pairs):
                self._close(sock)
            self._sel.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:  # the node is down: refuse, as the node itself would
            client.close()
            return
        for s in (client, upstream):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(client, upstream)
        self._pairs[client] = self._pairs[upstream] = pair
        self._sel.register(client, selectors.EVENT_READ)
        self._sel.register(upstream, selectors.EVENT_READ)
        self.connections += 1

    def _rearm(self) -> None:
        """Silent: watch nothing (bytes stay in the kernel's buffers). Else read every socket
        whose peer has room, and write where bytes are pending."""
        for sock, pair in list(self._pairs.items()):
            if self._silent.is_set():
                events = 0
            else:
                events = selectors.EVENT_READ if len(pair.pending[pair.other(sock)]) < BUFFER_BYTES else 0
                if pair.pending[sock]:
                    events |= selectors.EVENT_WRITE
            try:
                if events:
                    self._sel.modify(sock, events)
                else:
                    self._sel.unregister(sock)
            except KeyError:
                if events:
                    self._sel.register(sock, events)
            except (ValueError, OSError):
                self._close(sock)

    def _service(self, sock: socket.socket, mask: int) -> None:
        pair = self._pairs[sock]
        if mask & selectors.EVENT_READ:
            try:
                data = sock.recv(BUFFER_BYTES)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":
                self._flush(pair.other(sock), pair)
                self._close(sock)
                return
            if data:
                pair.pending[pair.other(sock)] += data
        if mask & selectors.EVENT_WRITE and sock in self._pairs:
            buf = pair.pending[sock]
            try:
                sent = sock.send(buf)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    self._close(sock)
                    return
                sent = 0
            del buf[:sent]
            self.forwarded_bytes += sent

    def _flush(self, sock: socket.socket, pair: _Pair) -> None:
        """What one side sent before it closed still goes to the other (bounded wait)."""
        buf = pair.pending[sock]
        if not buf:
            return
        try:
            sock.settimeout(1.0)
            sock.sendall(bytes(buf))
            self.forwarded_bytes += len(buf)
        except OSError:
            pass
        buf.clear()

    def _close(self, sock: socket.socket) -> None:
        """One side closed: close both (what was pending for the closed side is lost, as on a
        real connection that broke)."""
        pair = self._pairs.pop(sock, None)
        if pair is None:
            return
        for s in (pair.client, pair.upstream):
            self._pairs.pop(s, None)
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
