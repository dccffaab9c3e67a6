"""Issue 49: a prefix fetch moves KV only between members of the cluster (node/peer_trust.py,
security/cluster_token.py), and its reservation neither leaks nor lets a late push in.

Real parts: two prefill nodes in this process sharing a cluster token (tiny model, 4-token
blocks), real Redis; a rogue holder in a process of its own (``python -m
tests.test_prefix_trust_fetch ROGUE LOG``: a real gRPC KVHolder that, when asked, pushes
garbage into the reservation with the token it was given and then claims success); a stranger
socket that counts who dials it. Faults driven for real: a wedged engine thread on the fetching
node (its reserve command times out) and on the holder (the fetch outlasts the reservation
lease)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import types
import uuid
from concurrent import futures

import grpc
import pytest

from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc

BS = 4  # node_engine_config's block size


# ----------------------------------------------------------------------------- the rogue holder
class _Rogue(kv_pb2_grpc.KVHolderServicer):
    def __init__(self, log_path: str) -> None:
        self.log_path = log_path

    def _log(self, **entry) -> None:
        with open(self.log_path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def PushPrefix(self, request, context):
        sent_mac = any(k == "x-pdserve-cluster-mac" for k, _ in context.invocation_metadata())
        header = kv_pb2.KVHeader(  # what a stranger knows: the request, and the token it was handed
            request_id=request.request_id, model_fingerprint=request.model_fingerprint,
            block_size=request.block_size, first_block_index=request.first_block_index,
            dest_block_ids=request.dest_block_ids, block_hashes=request.block_hashes, token=request.token)
        garbage = kv_pb2.KVBlockMessage(chunk=kv_pb2.KVChunk(seq=0, data=b"\x7f" * 4096, raw_bytes=4096))
        code = "OK"
        with grpc.insecure_channel(request.dest_address) as ch:
            try:
                kv_pb2_grpc.KVTransferStub(ch).PushBlocks(iter([kv_pb2.KVBlockMessage(header=header), garbage]),
                                                          timeout=5)
            except grpc.RpcError as err:
                code = err.code().name
        self._log(called=True, mac=sent_mac, push=code)
        n = len(request.dest_block_ids)
        return kv_pb2.PushPrefixResponse(blocks_sent=n, bytes_sent=n * 4096, transport="grpc")  # a lie


def rogue_main(log_path: str) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    kv_pb2_grpc.add_KVHolderServicer_to_server(_Rogue(log_path), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"address 127.0.0.1:{port}", flush=True)
    sys.stdin.read()  # until the test closes it (or dies)
    server.stop(0)


class RogueProcess:
    def __init__(self, log_path) -> None:
        from tests.helpers import REPO

        self.log_path = log_path
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.test_prefix_trust_fetch", "ROGUE", str(log_path)],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("address "), line
        self.address = line.split()[1]

    def calls(self) -> list[dict]:
        if not self.log_path.exists():
            return []
        return [json.loads(x) for x in self.log_path.read_text().splitlines()]

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc.stdout.close()


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def cluster(tiny_dir, redis_url, tmp_path_factory):
    from security.cluster_token import ClusterToken, generate_token
    from tests.clusters import start_node
    from tests.helpers import node_engine_config

    tmp = tmp_path_factory.mktemp("trust")
    token_file = tmp / "cluster-token"
    token_file.write_text(generate_token())
    ns = f"trust-{uuid.uuid4().hex[:6]}"
    kw = dict(redis_url=redis_url, namespace=ns, lease_s=1.0, heartbeat_s=0.1, cluster_token_file=str(token_file))
    holder = start_node("prefill", "h0", node_engine_config(tiny_dir), **kw)
    # A short lease of its own, so a fetch that outlasts it is cheap to drive.
    fetcher = start_node("prefill", "p0", node_engine_config(tiny_dir), reservation_lease_s=0.5, **kw)
    rogue = RogueProcess(tmp / "rogue.log")
    c = types.SimpleNamespace(ns=ns, holder=holder, fetcher=fetcher, rogue=rogue, fp=fetcher.engine.fingerprint,
                              token=ClusterToken.from_file(str(token_file)), channels={})
    yield c
    rogue.stop()
    for ch in c.channels.values():
        ch.close()
    for n in (holder, fetcher):
        n.stop(grace_s=0)


def _stub(c, cls, address: str):
    if address not in c.channels:
        c.channels[address] = grpc.insecure_channel(address)
    return cls(c.channels[address])


def _prefill(c, node, ids: list[int], holder: str | None = None) -> kv_pb2.PrefillResponse:
    """A Prefill call with nothing to send (no decode reservation), fetching from ``holder``."""
    from protos.convert import sampling_to_proto
    from tokens.sampling_params import SamplingParams

    fetch = kv_pb2.KVFetch(holder_address=holder, num_blocks=(len(ids) - 1) // BS, timeout_s=5) if holder else None
    return _stub(c, kv_pb2_grpc.PrefillNodeStub, node.address).Prefill(kv_pb2.PrefillRequest(
        request_id=f"r-{uuid.uuid4().hex[:6]}", prompt_token_ids=ids, fetch=fetch,
        sampling=sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=1))), timeout=30)


def _fetch(c, ids: list[int], holder: str, timeout_s: float = 5.0):
    """The fetch alone (the first step of Prefill) -> (outcome, the tier of each leading block of
    the prefix the fetching node now holds, in any tier), its hold released again."""
    rid = f"f-{uuid.uuid4().hex[:6]}"
    n = (len(ids) - 1) // BS
    out = c.fetcher.fetcher.fetch(rid, ids, kv_pb2.KVFetch(holder_address=holder, num_blocks=n, timeout_s=timeout_s))
    hashes = _hashes(c, ids[: n * BS])
    held = c.fetcher.aengine.held_prefix(hashes, ids)
    c.fetcher.fetcher.done(rid)
    return out, held


def _hashes(c, tokens: list[int]) -> list[int]:
    from tokens.block_hash import hash_prompt_blocks

    return hash_prompt_blocks(tokens, BS, c.fp.encode())


def _idle(node) -> bool:
    """Nothing held or reserved: every block free, no reservation left."""
    return (node.aengine.run(lambda e: e.kv.num_free_blocks) == node.engine.num_blocks
            and len(node.inbox.reservations) == 0)


# ----------------------------------------------------------------------------- a rogue holder
def test_a_holder_outside_the_registry_is_refused_and_never_dialled(cluster):
    from tests.helpers import prompt

    c = cluster
    ids = prompt(101, 33)
    before = c.fetcher.metrics.registry.get_sample_value(
        "pdserve:kv_fetch_total", {**c.fetcher.metrics.labels, "outcome": "refused"}) or 0.0
    out, held = _fetch(c, ids, c.rogue.address)
    assert (out.outcome, out.blocks) == ("refused", 0)
    assert held == []  # nothing cached, in no tier
    resp = _prefill(c, c.fetcher, ids, holder=c.rogue.address)  # named in a Prefill call
    assert (resp.fetch_outcome, resp.fetch_blocks, resp.cached_tokens) == ("refused", 0, 0), resp
    assert c.rogue.calls() == []  # never dialled
    assert c.fetcher.metrics.registry.get_sample_value(
        "pdserve:kv_fetch_total", {**c.fetcher.metrics.labels, "outcome": "refused"}) == before + 2
    assert _idle(c.fetcher)


def test_a_registered_stranger_without_the_token_writes_nothing(cluster, redis_url):
    """Someone wrote the rogue into the registry (it looks like a node): it is dialled, but the
    token it is handed is a nonce, so its push is refused before a byte lands; its claim of
    success registers nothing, and what the prefill caches is this node's own computation."""
    import torch

    from kv_index.client import redis_client
    from kv_index.nodes import NodeInfo
    from kv_index.publisher import NodePublisher
    from tests.helpers import prompt, wait_for

    c = cluster
    fake = NodePublisher(redis_client(redis_url), NodeInfo(
        node_id="prefill-rogue", role="prefill", grpc_address=c.rogue.address, fingerprint=c.fp, block_size=BS,
        num_blocks=64), ns=c.ns, lease_s=30)
    fake.register()
    try:  # the fetching node's view of the registry takes a moment (MIN_REFRESH_S) to see it
        assert wait_for(lambda: c.fetcher.fetcher.trust.registry.lookup(c.rogue.address) is not None, timeout=5)
        ids = prompt(102, 33)
        n = (len(ids) - 1) // BS
        out, held = _fetch(c, ids, c.rogue.address)
        assert (out.outcome, out.blocks) == ("failed", 0)
        assert held == []  # nothing cached, in no tier
        assert c.rogue.calls() == [{"called": True, "mac": True, "push": "PERMISSION_DENIED"}]
        resp = _prefill(c, c.fetcher, ids, holder=c.rogue.address)
        assert (resp.fetch_outcome, resp.cached_tokens) == ("failed", 0), resp
        assert [x["push"] for x in c.rogue.calls()] == ["PERMISSION_DENIED"] * 2
    finally:
        fake.deregister()
    # The blocks cached now are the prefill's own: bit-identical to the honest holder's.
    _prefill(c, c.holder, ids)
    hashes = _hashes(c, ids[: n * BS])
    src = [c.holder.engine.kv.pool.cached[h].block_id for h in hashes]
    dst = [c.fetcher.engine.kv.pool.cached[h].block_id for h in hashes]
    assert torch.equal(c.holder.engine.kv_cache[:, src], c.fetcher.engine.kv_cache[:, dst])
    assert wait_for(lambda: _idle(c.fetcher), timeout=5)


# ----------------------------------------------------------------------------- the holder's side
def _push_prefix(c, ids: list[int], *, dest: str, endpoints=(), nonce: bytes = b"n" * 16, token=None,
                 request_id: str = "probe/fetch", dest_block_ids=None):
    """PushPrefix on the holder for ``ids``' full blocks, signed with ``token`` (None: unsigned)."""
    n = (len(ids) - 1) // BS
    req = kv_pb2.PushPrefixRequest(
        request_id=request_id, model_fingerprint=c.fp, block_size=BS, token_ids=ids[: n * BS],
        block_hashes=_hashes(c, ids[: n * BS]), first_block_index=0,
        dest_block_ids=list(range(n)) if dest_block_ids is None else dest_block_ids,
        dest_address=dest, dest_kv_endpoints=list(endpoints), token=nonce)
    metadata = token.metadata(req.SerializeToString(deterministic=True)) if token is not None else None
    return _stub(c, kv_pb2_grpc.KVHolderStub, c.holder.address).PushPrefix(req, timeout=10, metadata=metadata)


def test_a_member_fetches_and_a_stranger_cannot_make_the_holder_probe_pin_or_dial(cluster):
    from security.cluster_token import ClusterToken, generate_token
    from tests.helpers import prompt

    c = cluster
    ids = prompt(103, 33)
    _prefill(c, c.holder, ids)  # the holder caches the prefix
    out, held = _fetch(c, ids, c.holder.address)  # a member: the derived token opens the reservation
    assert (out.outcome, out.blocks, len(held)) == ("ok", 8, 8), out
    stranger = socket.create_server(("127.0.0.1", 0))
    stranger.settimeout(0.3)
    there = f"127.0.0.1:{stranger.getsockname()[1]}"
    pushes = c.holder.holder.num_pushes
    try:
        cases = [
            (dict(dest=c.fetcher.address), grpc.StatusCode.UNAUTHENTICATED, "x-pdserve-cluster-mac"),
            (dict(dest=there, token=ClusterToken(generate_token().encode())), grpc.StatusCode.PERMISSION_DENIED,
             "not this cluster's token"),
            (dict(dest=there, token=c.token), grpc.StatusCode.PERMISSION_DENIED, "no live node of this cluster"),
            (dict(dest=c.fetcher.address, endpoints=[f"tcp://10.9.9.9:{stranger.getsockname()[1]}"], token=c.token),
             grpc.StatusCode.PERMISSION_DENIED, "not a data endpoint on p0's host"),
        ]
        for kw, code, says in cases:
            with pytest.raises(grpc.RpcError) as err:
                _push_prefix(c, ids, **kw)
            assert (err.value.code(), says in err.value.details()) == (code, True), err.value.details()
        with pytest.raises(socket.timeout):
            stranger.accept()  # nobody dialled it
    finally:
        stranger.close()
    assert c.holder.holder.num_pushes == pushes and _idle(c.holder)  # nothing pinned, nothing pushed


# ----------------------------------------------------------------------------- the fetch's reservation
def test_a_timed_out_reserve_on_a_wedged_engine_leaks_nothing(cluster):
    from tests.helpers import prompt, wait_for

    c = cluster
    ids = prompt(104, 33)
    _prefill(c, c.holder, ids)
    c.fetcher.aengine.call(lambda e: time.sleep(1.0))  # the fetching node's engine thread is stuck
    out, _ = _fetch(c, ids, c.holder.address, timeout_s=0.3)
    assert out.outcome == "timeout" and 0.3 <= out.seconds < 1.0, out
    # Once the loop moves again the reservation it never answered in time is not made (or is
    # undone): every block is free.
    assert wait_for(lambda: _idle(c.fetcher), timeout=5)


def test_a_fetch_longer_than_the_reservation_lease_still_lands(cluster):
    """The fetching node's reservations wait 0.5 s by default; the holder's engine is stuck for
    1.2 s before it can pin, inside the fetch's 5 s bound: the fetch's own lease covers it."""
    from tests.helpers import prompt

    c = cluster
    ids = prompt(105, 33)
    _prefill(c, c.holder, ids)
    c.holder.aengine.call(lambda e: time.sleep(1.2))
    out, held = _fetch(c, ids, c.holder.address, timeout_s=5.0)
    assert (out.outcome, out.blocks, len(held)) == ("ok", 8, 8) and out.seconds >= 1.0, out
    assert _idle(c.fetcher)


def test_a_late_push_after_the_fetch_closed_its_reservation_writes_nothing(cluster):
    """A reservation made as a fetch makes it, one honest push landed, the fetch closed it; the
    same push again (late, or a second one) is refused for want of a reservation, not a byte
    written into blocks that are about to be shared cache."""
    import torch

    from kv_transfer.validate import Reservation, new_token
    from node.prefix_kv import reserve_prefix
    from tests.helpers import prompt

    c = cluster
    ids = prompt(106, 33)
    n = (len(ids) - 1) // BS
    _prefill(c, c.holder, ids)
    tokens, hashes, hold = ids[: n * BS], _hashes(c, ids[: n * BS]), "late/fetch"
    held, dest = c.fetcher.aengine.run(lambda e: reserve_prefix(e, hold, hashes, tokens))
    nonce = new_token()
    c.fetcher.inbox.reservations.add(hold, Reservation(held, tuple(dest), tuple(hashes[held:]),
                                                       c.token.push_token(nonce)), tuple(tokens))
    try:
        push = dict(dest=c.fetcher.address, endpoints=c.fetcher.inbox.kv_endpoints(), nonce=nonce, token=c.token,
                    request_id=hold, dest_block_ids=dest)
        assert _push_prefix(c, ids, **push).blocks_sent == n
        assert c.fetcher.inbox.reservations.close_prefix(hold) == n
        landed = c.fetcher.engine.kv_cache[:, dest].clone()
        with pytest.raises(grpc.RpcError) as err:
            _push_prefix(c, ids, **push)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
        assert torch.equal(c.fetcher.engine.kv_cache[:, dest], landed)
    finally:
        c.fetcher.aengine.release_kv(hold)
    assert _idle(c.fetcher)


if __name__ == "__main__" and sys.argv[1:2] == ["ROGUE"]:
    rogue_main(sys.argv[2])
