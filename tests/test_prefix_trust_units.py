"""Issue 49, prefix fetch's trust: the plain logic under the real-node tests of
tests/test_prefix_trust_fetch.py. The cluster token (security/cluster_token.py), the peer
registry and endpoint checks (node/peer_trust.py, over a real Redis), a fetch reservation's own
lease and its closing (node/reservations.py), and `pdserve nodes` refusing an exposed bind
(deploy/nodes.py)."""
from __future__ import annotations

import argparse
import uuid

import grpc
import pytest

from kv_index.client import redis_client
from kv_index.nodes import NodeInfo
from kv_index.publisher import NodePublisher
from kv_transfer.validate import Reservation
from node.peer_trust import MIN_REFRESH_S, REFRESH_S, PeerRegistry, endpoint_host
from node.reservations import ReservationTable
from security.cluster_token import MAC_METADATA_KEY, MIN_TOKEN_CHARS, ClusterToken, generate_token


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ----------------------------------------------------------------------------- the cluster token
def test_a_token_file_too_short_or_unreadable_is_refused_by_name(tmp_path):
    short = tmp_path / "short"
    short.write_text("x" * (MIN_TOKEN_CHARS - 1) + "\n")
    with pytest.raises(ValueError, match=rf"short.*{MIN_TOKEN_CHARS - 1} characters; at least {MIN_TOKEN_CHARS}"):
        ClusterToken.from_file(str(short))
    with pytest.raises(OSError, match="cannot read the cluster token file .*missing"):
        ClusterToken.from_file(str(tmp_path / "missing"))
    good = tmp_path / "good"
    good.write_text(generate_token() + "\n")
    token = ClusterToken.from_file(str(good))
    assert good.read_text().strip() not in repr(token) and repr(token) == "ClusterToken(<hidden>)"


def test_the_mac_admits_only_the_same_token_and_the_same_request():
    a, b = ClusterToken(generate_token().encode()), ClusterToken(generate_token().encode())
    payload = b"a PushPrefixRequest's bytes"
    assert a.check(a.metadata(payload), payload) is None
    assert a.check((), payload)[0] is grpc.StatusCode.UNAUTHENTICATED
    assert MAC_METADATA_KEY in a.check((), payload)[1]
    assert a.check(b.metadata(payload), payload)[0] is grpc.StatusCode.PERMISSION_DENIED
    assert a.check(a.metadata(payload), payload + b"!")[0] is grpc.StatusCode.PERMISSION_DENIED
    # The push token is derived: another nonce or another cluster gives another one, and the
    # nonce a stranger sees is not it.
    nonce = b"n" * 16
    assert len(a.push_token(nonce)) == 16 and a.push_token(nonce) == a.push_token(nonce)
    assert len({a.push_token(nonce), a.push_token(b"m" * 16), b.push_token(nonce), nonce}) == 4


# ----------------------------------------------------------------------------- the peer registry
def test_the_registry_knows_live_nodes_only_and_sees_a_new_one_soon(redis_url):
    ns = f"trust-{uuid.uuid4().hex[:6]}"
    client = redis_client(redis_url)
    clock = Clock()
    registry = PeerRegistry(lambda: client, ns, clock)

    def publisher(nid: str, address: str) -> NodePublisher:
        info = NodeInfo(node_id=nid, role="prefill", grpc_address=address, fingerprint="fp", block_size=4,
                        num_blocks=8)
        return NodePublisher(client, info, ns=ns, lease_s=30)

    first = publisher("p0", "127.0.0.1:7001")
    first.register()
    assert registry.lookup("127.0.0.1:7001").node_id == "p0"
    assert registry.lookup("127.0.0.1:7002") is None
    second = publisher("p1", "127.0.0.1:7002")
    second.register()
    assert registry.lookup("127.0.0.1:7002") is None  # read too recently to ask Redis again
    clock.now += MIN_REFRESH_S
    assert registry.lookup("127.0.0.1:7002").node_id == "p1"  # an unknown address reads again
    first.deregister()
    assert registry.lookup("127.0.0.1:7001") is not None  # a known one waits for the refresh...
    clock.now += REFRESH_S
    assert registry.lookup("127.0.0.1:7001") is None  # ...then it is gone
    second.deregister()
    assert PeerRegistry(lambda: None, ns, clock).lookup("127.0.0.1:7002") is None  # not started: nobody


def test_endpoint_hosts():
    assert endpoint_host("tcp://10.0.0.5:7000") == "10.0.0.5"
    assert endpoint_host("dist://[fd00::7]:7000") == "fd00::7"
    assert endpoint_host("shm://boot-id/10.0.0.5:7000") == "10.0.0.5"
    assert [endpoint_host(e) for e in ("tcp://", "nfs://10.0.0.5:1", "shm://x", "tcp://h:port")] == [None] * 4


# ----------------------------------------------------------------------------- fetch reservations
def _reservation(blocks: int = 3) -> Reservation:
    return Reservation(0, tuple(range(blocks)), tuple(range(blocks)), b"t" * 16)


def test_a_fetch_reservation_keeps_its_own_lease():
    clock = Clock()
    table = ReservationTable(num_layers=2, lease_s=10.0, clock=clock)
    table.add("fetch", _reservation(), (), lease_s=31.0)  # the fetch's bound and a margin
    table.add("decode", _reservation(), ())
    clock.now += 10.0
    assert table.expire() == ["decode"]
    table.received("fetch", range(2), 0, 1)  # a push landed: its own lease again, not the table's
    clock.now += 30.0
    assert table.expire() == [] and table.get("fetch") is not None
    clock.now += 1.0
    assert table.expire() == ["fetch"]
    with pytest.raises(ValueError, match="lease must be > 0"):
        table.add("x", _reservation(), (), lease_s=0.0)


def test_closing_a_fetch_reservation_shuts_out_every_later_push():
    table = ReservationTable(num_layers=2, lease_s=10.0)
    table.add("f", _reservation(), ())
    assert table.begin_push("f")
    table.received("f", range(2), 0, 2)
    assert table.close_prefix("f") is None  # a push still writes: hidden, its end releases
    assert table.get("f") is None and not table.begin_push("f")
    assert table.end_push("f") is True and len(table) == 0
    table.add("g", _reservation(), ())
    table.received("g", range(2), 0, 2)
    assert table.close_prefix("g") == 2  # the leading blocks in every layer, and gone at once
    assert table.get("g") is None and not table.begin_push("g") and table.close_prefix("g") == 0


# ----------------------------------------------------------------------------- `pdserve nodes`
def _nodes_args(*argv: str) -> argparse.Namespace:
    from deploy import nodes

    p = argparse.ArgumentParser()
    nodes.add_arguments(p)
    return p.parse_args(["--redis-url", "redis://r:6379/0", *argv])


@pytest.mark.parametrize("argv, refused", [
    ((), True),  # its default --host 0.0.0.0, no TLS, no token
    (("--host", "10.1.2.3"), True),
    (("--host", "127.0.0.1"), False),
    (("--host", "::1"), False),
    (("--cluster-token-file", "/etc/pdserve/token"), False),
    (("--tls-cert-file", "c", "--tls-key-file", "k", "--tls-ca-file", "ca"), False),
])
def test_pdserve_nodes_refuses_an_exposed_plaintext_bind_by_name(argv, refused):
    from deploy import nodes
    from engine.config import EngineConfig

    a = _nodes_args(*argv)
    problem = nodes.bind_problem(nodes.template_from_args(a, EngineConfig(model="m"), {}))
    assert bool(problem) is refused
    if refused:  # said before Ray is asked anything, naming the ways out
        with pytest.raises(SystemExit) as err:
            nodes.run(a, EngineConfig(model="m"))
        for way in ("not loopback", "--tls-cert-file", "--cluster-token-file", "--insecure-bind"):
            assert way in str(err.value.code)
        assert _nodes_args(*argv, "--insecure-bind").insecure_bind
