"""What both ends of the decode node's data port share: its framing, socket options and
vectored I/O, and where same-host shared-memory buffers live. The senders are in
tcp_transport.py and shm_transport.py, the one receiver for both in receiver.py.

A transfer is framed protobufs plus raw bytes on a connection that is kept open and reused::

    frame := uint32 big-endian length, then that many bytes of protobuf
    sender -> [frame(KVBlockMessage attach: path, size)]         once per connection, shm only
              frame(KVBlockMessage header)
              { frame(KVBlockMessage chunk: seq, raw_bytes, checksum [, shm_offset])
                [raw_bytes bytes, tcp only] }*
              frame(KVBlockMessage trailer)
    sender <- frame(KVStreamReply: ok PushBlocksResponse | error code, message)

The payload order is wire.py's (layer-major units, one block-layer each).
"""
from __future__ import annotations

import socket
import struct
from collections import deque
from collections.abc import Callable, Sequence

from kv_transfer.validate import KVValidationError

# Frames are protobuf headers (~13 bytes per block) and small messages.
MAX_FRAME_BYTES = 16 << 20
# sendmsg and recvmsg_into take at most IOV_MAX (1024 on Linux) buffers per call.
MAX_IOV = 512
# Each end's socket buffers (the kernel doubles what is set).
SOCKET_BUFFER_BYTES = 4 << 20
# Shared-memory buffers senders on the same host attach (shm_transport.py): where they live,
# their name prefix, and the most a receiver maps.
SHM_DIR = "/dev/shm"
SHM_PREFIX = "pdserve-kv-"
MAX_SHM_BYTES = 1 << 30
_LEN = struct.Struct("!I")


def tune_socket(sock: socket.socket) -> None:
    """The options every data connection gets (both ends): no Nagle delay, keepalive, 4 MiB
    socket buffers. The transfer bench gives its raw-socket ceiling the same."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # idle kept connections to a dead peer end
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


def frame(message) -> bytes:
    """One frame: the message's length (uint32, big-endian) and its encoding."""
    body = message.SerializeToString()
    return _LEN.pack(len(body)) + body


def send_all(sock: socket.socket, buffers: Sequence,
             arm: Callable[[socket.socket], None] | None = None) -> None:
    """sendmsg until every buffer is out (a call may send part of them); ``arm(sock)`` runs
    before each call (a sender's Clock.arm: its time limits on that call's wait)."""
    views = deque(memoryview(b).cast("B") for b in buffers)
    while views:
        batch = [views[i] for i in range(min(len(views), MAX_IOV))]
        if arm is not None:
            arm(sock)
        advance(views, sock.sendmsg(batch))
        while views and not len(views[0]):
            views.popleft()


def advance(views: deque, n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (a vectored call moved that many)."""
    while n:
        head = views[0]
        if n >= len(head):
            n -= len(head)
            views.popleft()
        else:
            views[0] = head[n:]
            n = 0


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False if the peer closed before the first byte, ConnectionError if it
    closed part-way."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
        got += n
    return True


def read_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> bytes | None:
    """One frame's body; None on a clean close before it. KVValidationError for a length
    over ``max_bytes`` (the peer is not speaking this protocol, or is out of step), before
    anything is allocated for it."""
    head = bytearray(_LEN.size)
    if not recv_exact(sock, memoryview(head)):
        return None
    (n,) = _LEN.unpack(head)
    if n > max_bytes:
        raise KVValidationError(f"frame length: got {n} bytes, expected <= {max_bytes}")
    body = bytearray(n)
    if n and not recv_exact(sock, memoryview(body)):
        raise ConnectionError("peer closed inside a frame")
    return bytes(body)
