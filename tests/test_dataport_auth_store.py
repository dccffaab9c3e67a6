"""Strangers on the rendezvous stores (issue 49): the dist transport's TCPStore
(kv_transfer/dist_group.py) listens only on the interface the data connection came in on and
holds neither the group's key nor a gloo address in the clear (``SealedStore``), so a stranger
who lists and reads it learns nothing and a value it forges fails the set-up; the
tensor-parallel ranks' store (engine/parallel/worker.py) listens on loopback only. Real sockets,
real TCPStores, a real gloo group."""
from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
from torch.distributed import HashStore, TCPStore

from engine.parallel.worker import open_store
from kv_transfer.data_port import frame
from kv_transfer.dist_group import SealedStore, sender_group
from kv_transfer.receiver import TcpKVServer
from kv_transfer.tcp_transport import read_reply
from kv_transfer.validate import Reservation
from protos.pdserve.v1 import kv_pb2
from tests.helpers import wait_for
from tests.test_kv_transfer import FP, TOKEN, make_pool

LOOPBACK_IPV4 = b"\x7f\x00\x00\x01"  # what a gloo address of a loopback rank holds in the clear


def _other_interface() -> str | None:
    """This host's address on a non-loopback interface (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            host = s.getsockname()[0]
        except OSError:
            return None
    return None if host.startswith("127.") else host


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_sealed_store_hides_names_and_values_and_refuses_a_forged_value() -> None:
    inner = HashStore()
    mine, peer, stranger = SealedStore(inner, "k1"), SealedStore(inner, "k1"), SealedStore(inner, "k2")
    mine.set("0/0", b"\x02\x00" + LOOPBACK_IPV4 + b"addr")
    assert peer.get("0/0") == b"\x02\x00" + LOOPBACK_IPV4 + b"addr"  # the peer with the key reads it
    (name,) = inner.list_keys()
    assert "k1" not in name and "0/0" not in name and LOOPBACK_IPV4 not in inner.get(name)
    with pytest.raises(RuntimeError, match="not this group's"):
        stranger.open("0/0", inner.get(name))  # another key cannot open it
    inner.set(name, b"a stranger's own address")
    with pytest.raises(RuntimeError, match="not this group's"):
        peer.get("0/0")  # nor can a value a stranger wrote pass as the peer's
    mine.forget()
    assert inner.num_keys() == 0


def test_a_stranger_on_the_dist_store_learns_nothing_and_cannot_reach_it_from_another_interface() -> None:
    """A data port on every interface, a dist sender on loopback: its group's store is bound to
    loopback; a stranger there reads every entry while the group forms and finds neither the
    key nor an address; the group still forms (and moves KV: tests/test_kv_transfer_dist.py)."""
    reservations = {"r": Reservation(0, (4,), (), TOKEN)}
    server = TcpKVServer(make_pool(torch.float32, seed=1), FP, on_received=lambda r: None,
                         reservation_for=reservations.get, host="0.0.0.0", dist=True)
    server.start()
    group = None
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            attach = kv_pb2.KVDistAttach(request_id="r", token=TOKEN, chunk_bytes=1 << 20)
            sock.sendall(frame(kv_pb2.KVBlockMessage(dist_attach=attach)))
            ready = read_reply(sock).dist
            assert ready.store_port == server.dist.port("127.0.0.1")
            other = _other_interface()
            if other is not None:  # bound to the interface the peer came in on, not 0.0.0.0
                assert _refused(other, ready.store_port)
            stranger = TCPStore("127.0.0.1", ready.store_port, None, False, timedelta(seconds=5))
            assert wait_for(stranger.list_keys, timeout=5)  # the receiver has written its entry
            entries = {k: stranger.get(k) for k in stranger.list_keys()}
            assert not any(ready.group_key in k or ready.group_key.encode() in v for k, v in entries.items())
            assert not any(LOOPBACK_IPV4 in v for v in entries.values())  # no gloo address either
            group = sender_group("127.0.0.1", ready, sock.getsockname()[0])  # the real peer still joins
            assert wait_for(lambda: server.dist.groups_made == 1, timeout=5)
    finally:
        if group is not None:
            group.close()
        server.stop()


def test_the_tensor_parallel_store_listens_on_loopback_only() -> None:
    store = open_store(0, 2, True, 5.0)
    client = open_store(store.port, 2, False, 5.0)
    client.set("k", b"v")
    assert store.get("k") == b"v"  # the ranks still meet on loopback
    other = _other_interface()
    if other is None:
        pytest.skip("no non-loopback interface to try")
    assert _refused(other, store.port)
