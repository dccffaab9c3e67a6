"""Prefix fetch (issue 27, section 2): a prefill node brings the leading blocks another node holds
over the KV transports (node/prefix_fetch.py, node/prefix_holder.py) instead of computing them.

Real parts: node servers in this process (tiny random model, 4-token blocks) and, for the
freeze and kill cases, a holder node in a process of its own (tests/node_process.py); real
Redis, gRPC and the shm / tcp / gRPC transports; a router for the multi-turn case. Checked: the
fetched KV is bit-identical to the holder's, greedy outputs equal a single engine's with fetch on
and off, a corrupt, frozen or killed holder means the prefix is computed (same output, the
outcome counted), and only the reservation's token opens a fetch reservation."""
from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import grpc
import pytest
import torch

from kv_transfer.grpc_transport import GrpcKVSender
from kv_transfer.tcp_transport import TcpKVSender
from kv_transfer.transport import FallbackKVSender
from kv_transfer.validate import Reservation, new_token
from node.prefix_kv import reserve_prefix
from protos.convert import sampling_to_proto
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from tests.clusters import start_node, start_router
from tests.helpers import node_engine_config, prompt, tokens_of, wait_for
from tokens.block_hash import hash_prompt_blocks
from tokens.sampling_params import SamplingParams

BS = 4  # node_engine_config's block size
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)


class Nodes:
    """A holder and a fetching prefill node, and a decode node, driven by hand."""

    def __init__(self, model, redis_url: str) -> None:
        self.ns = f"fetch-{uuid.uuid4().hex[:6]}"
        kw = dict(redis_url=redis_url, namespace=self.ns, lease_s=1.0, heartbeat_s=0.1)
        self.holder = start_node("prefill", "h0", node_engine_config(model), **kw)
        self.fetcher = start_node("prefill", "p0", node_engine_config(model), **kw)
        self.decode = start_node("decode", "d0", node_engine_config(model), **kw)
        self.fp = self.fetcher.engine.fingerprint
        self._channels: dict[str, grpc.Channel] = {}

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        for n in (self.holder, self.fetcher, self.decode):
            if n.aengine.alive:
                n.stop(grace_s=0)

    def channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.insecure_channel(address)
        return self._channels[address]

    def warm(self, address: str, ids: list[int]) -> None:
        """Prefill ``ids`` on the node at ``address`` with nothing to send: it caches them."""
        kv_pb2_grpc.PrefillNodeStub(self.channel(address)).Prefill(kv_pb2.PrefillRequest(
            request_id=f"warm-{uuid.uuid4().hex[:6]}", prompt_token_ids=ids, sampling=sampling_to_proto(GREEDY)),
            timeout=30)

    def run(self, ids: list[int], holder: str | None, timeout_s: float = 5.0) -> tuple[kv_pb2.PrefillResponse, list]:
        """Reserve on the decode node, prefill on the fetching node (fetching the prompt's head
        from ``holder``), decode -> (the prefill's response, the tokens)."""
        rid = f"r-{uuid.uuid4().hex[:6]}"
        res = kv_pb2_grpc.KVTransferStub(self.channel(self.decode.address)).ReserveBlocks(kv_pb2.ReserveBlocksRequest(
            request_id=rid, model_fingerprint=self.fp, block_size=BS, num_tokens=len(ids),
            block_hashes=hash_prompt_blocks(ids, BS, self.fp.encode()), prompt_token_ids=ids), timeout=10)
        fetch = (kv_pb2.KVFetch(holder_address=holder, num_blocks=(len(ids) - 1) // BS, timeout_s=timeout_s)
                 if holder else None)
        pre = kv_pb2_grpc.PrefillNodeStub(self.channel(self.fetcher.address)).Prefill(kv_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=ids, sampling=sampling_to_proto(GREEDY), decode_address=self.decode.address,
            reservation=res, fetch=fetch), timeout=60)
        msgs = kv_pb2_grpc.DecodeNodeStub(self.channel(self.decode.address)).Decode(kv_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=ids, sampling=sampling_to_proto(GREEDY),
            first_token_ids=list(pre.first_token_ids), cached_prompt_tokens=pre.cached_tokens), timeout=60)
        return pre, tokens_of(msgs)

    def fetches(self, outcome: str) -> float:
        m = self.fetcher.metrics
        return m.registry.get_sample_value("pdserve:kv_fetch_total", {**m.labels, "outcome": outcome}) or 0.0


def free_blocks(node) -> int:
    return node.aengine.run(lambda e: e.kv.num_free_blocks)


@pytest.fixture(scope="module")
def nodes(tiny_dir, redis_url):
    n = Nodes(tiny_dir, redis_url)
    yield n
    n.close()


@pytest.fixture(scope="module")
def reference(tiny_dir):
    from engine.engine import LLMEngine

    engine = LLMEngine(node_engine_config(tiny_dir), load_tokenizer=False)
    return lambda ids: list(engine.generate([ids], GREEDY)[0].outputs[0].token_ids)


def only(node, transport: str) -> FallbackKVSender:
    """Make ``node`` push over ``transport`` alone (then gRPC); returns the sender it had."""
    had = node.kv_sender
    fast = {"shm": None, "tcp": [TcpKVSender()], "grpc": []}[transport]
    if fast is not None:
        node.kv_sender = FallbackKVSender(fast, GrpcKVSender())
    return had


@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
def test_a_fetched_prefix_is_bit_identical_and_the_output_unchanged(nodes, reference, transport):
    ids = prompt({"shm": 11, "tcp": 12, "grpc": 13}[transport], 45)  # 11 full blocks fetched, the 12th computed
    n = (len(ids) - 1) // BS
    nodes.warm(nodes.holder.address, ids)
    had = only(nodes.holder, transport)
    try:
        before = nodes.fetches("ok")
        pre, tokens = nodes.run(ids, nodes.holder.address)
    finally:
        if nodes.holder.kv_sender is not had:
            nodes.holder.kv_sender.close()
            nodes.holder.kv_sender = had
    assert (pre.fetch_outcome, pre.fetch_blocks, pre.fetch_transport) == ("ok", n, transport), pre
    assert pre.cached_tokens == n * BS and pre.fetch_bytes > 0 and pre.fetch_s > 0  # the prefill hit them
    assert nodes.fetches("ok") == before + 1
    assert tokens == reference(ids)
    hashes = hash_prompt_blocks(ids, BS, nodes.fp.encode())[:n]
    src = [nodes.holder.engine.kv.pool.cached[h].block_id for h in hashes]
    dst = [nodes.fetcher.engine.kv.pool.cached[h].block_id for h in hashes]
    assert torch.equal(nodes.holder.engine.kv_cache[:, src], nodes.fetcher.engine.kv_cache[:, dst])
    # Nothing stays pinned: the holder's push and the fetcher's hold are both released.
    for node in (nodes.holder, nodes.fetcher):
        assert free_blocks(node) == node.engine.num_blocks


@pytest.mark.parametrize("mode", ["flip", "cut"])
def test_a_corrupt_fetch_is_computed_with_the_same_output(nodes, reference, mode):
    ids = prompt({"flip": 31, "cut": 32}[mode], 41)
    nodes.warm(nodes.holder.address, ids)
    before = nodes.fetches("corrupt")
    nodes.holder.set_kv_fault(mode)  # every transport the holder sends over damages its pushes
    try:
        pre, tokens = nodes.run(ids, nodes.holder.address)
    finally:
        nodes.holder.set_kv_fault(None)
    assert (pre.fetch_outcome, pre.fetch_blocks, pre.cached_tokens) == ("corrupt", 0, 0), pre
    assert nodes.fetches("corrupt") == before + 1
    assert tokens == reference(ids)
    for node in (nodes.holder, nodes.fetcher):
        assert free_blocks(node) == node.engine.num_blocks


def test_only_the_reservation_token_opens_a_fetch_reservation(nodes):
    """The holder pushes with the token it was given; the fetching node's receivers refuse a
    push without it (UNAUTHENTICATED) or with another one (PERMISSION_DENIED) and write nothing."""
    ids = prompt(41, 33)
    nodes.warm(nodes.holder.address, ids)
    n = (len(ids) - 1) // BS
    tokens, hashes = ids[: n * BS], hash_prompt_blocks(ids[: n * BS], BS, nodes.fp.encode())
    fetcher, hold = nodes.fetcher, "token-test/fetch"
    held, dest = fetcher.aengine.run(lambda e: reserve_prefix(e, hold, hashes, tokens))
    token = new_token()
    fetcher.inbox.reservations.add(hold, Reservation(held, tuple(dest), tuple(hashes[held:]), token), tuple(tokens))
    before = fetcher.engine.kv_cache[:, dest].clone()
    stub = kv_pb2_grpc.KVHolderStub(nodes.channel(nodes.holder.address))

    def push(tok: bytes):
        return stub.PushPrefix(kv_pb2.PushPrefixRequest(
            request_id=hold, model_fingerprint=nodes.fp, block_size=BS, token_ids=tokens, block_hashes=hashes,
            first_block_index=held, dest_block_ids=dest, dest_address=fetcher.address,
            dest_kv_endpoints=fetcher.inbox.kv_endpoints(), token=tok), timeout=10)

    try:
        for tok, code in ((b"", grpc.StatusCode.UNAUTHENTICATED), (new_token(), grpc.StatusCode.PERMISSION_DENIED)):
            with pytest.raises(grpc.RpcError) as err:
                push(tok)
            assert err.value.code() == code, err.value.details()
            assert fetcher.inbox.reservations.complete_prefix(hold) == 0
            assert torch.equal(fetcher.engine.kv_cache[:, dest], before)  # not a byte written
        assert push(token).blocks_sent == n - held
        assert fetcher.inbox.reservations.complete_prefix(hold) == n - held
    finally:
        fetcher.inbox.drop(hold)
    assert free_blocks(fetcher) == fetcher.engine.num_blocks
    # A holder asked for hashes that are not its tokens' refuses before it pins anything.
    with pytest.raises(grpc.RpcError) as err:
        stub.PushPrefix(kv_pb2.PushPrefixRequest(
            request_id="x", model_fingerprint=nodes.fp, block_size=BS, token_ids=tokens, block_hashes=hashes[::-1],
            first_block_index=0, dest_block_ids=list(range(n)), dest_address=fetcher.address, token=token), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chained hashes" in err.value.details()


def test_a_prefix_the_holder_keeps_in_host_memory_is_onboarded_then_fetched(nodes, reference, tiny_dir, redis_url):
    """The holder's device pool (16 blocks) evicted the prefix; its host tier kept it. The index
    says so (host blocks), the holder copies it back to its device and pushes it."""
    from dataclasses import replace

    from kv_index.client import redis_client
    from kv_index.reader import IndexReader
    from kv_index.schema import TIER_HOST

    cfg = node_engine_config(tiny_dir, num_blocks=16)
    block_bytes = nodes.fetcher.engine.kv_cache[:, 0].numel() * 4
    cfg = replace(cfg, cache=replace(cfg.cache, host_cache_mib=64 * block_bytes / 2**20))
    holder = start_node("prefill", "h2", cfg, redis_url=redis_url, namespace=nodes.ns, lease_s=1.0, heartbeat_s=0.1)
    reader = IndexReader(redis_client(redis_url), nodes.ns)
    try:
        ids = prompt(81, 45)
        hashes = hash_prompt_blocks(ids, BS, nodes.fp.encode())[:11]
        nodes.warm(holder.address, ids)
        for seed in (82, 83):  # two more prompts of 12 blocks: the first one's leave the device
            nodes.warm(holder.address, prompt(seed, 45))
        assert wait_for(lambda: reader.match(hashes, ["h2"])["h2"].host > 0, timeout=10)
        # A block the device evicted before its host copy was made is gone: the holder keeps a
        # head of the chain, and pushes that much (fewer blocks than reserved: a partial fetch).
        assert wait_for(lambda: not holder.aengine.run(lambda e: e.tiers_busy), timeout=10)  # copies settled
        held = holder.aengine.run(lambda e: e.held_prefix(hashes, ids))
        pre, tokens = nodes.run(ids, holder.address)
        assert (pre.fetch_outcome, pre.fetch_blocks, pre.cached_tokens) == ("ok", len(held), len(held) * BS), pre
        assert pre.fetch_onboarded_host_blocks == held.count(TIER_HOST) > 0 and pre.fetch_onboard_s > 0
        # ... and its heartbeat tells every router what onboarding costs it (OnboardTotals).
        assert wait_for(lambda: reader.live_nodes()["h2"].onboard_host.runs > 0, timeout=10)
        assert tokens == reference(ids)
        src = [holder.engine.kv.pool.cached[h].block_id for h in hashes[: len(held)]]  # back on its device
        dst = [nodes.fetcher.engine.kv.pool.cached[h].block_id for h in hashes[: len(held)]]
        assert torch.equal(holder.engine.kv_cache[:, src], nodes.fetcher.engine.kv_cache[:, dst])
    finally:
        holder.stop(grace_s=0)


@pytest.fixture(scope="module")
def holder_process(tiny_dir, redis_url, nodes):
    from tests.node_process import NodeProcess

    proc = NodeProcess("prefill", "h1", str(tiny_dir), redis_url=redis_url, namespace=nodes.ns)
    yield proc
    proc.stop()


def test_a_frozen_holder_costs_the_fetch_bound_then_the_prefix_is_computed(nodes, reference, holder_process):
    ids = prompt(51, 45)
    nodes.warm(holder_process.address, ids)
    before = nodes.fetches("timeout")
    os.kill(holder_process.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        pre, tokens = nodes.run(ids, holder_process.address, timeout_s=1.0)
        waited = time.monotonic() - t0
    finally:
        os.kill(holder_process.pid, signal.SIGCONT)
    assert (pre.fetch_outcome, pre.cached_tokens) == ("timeout", 0), pre
    assert 1.0 <= pre.fetch_s < 5.0 and waited < 15.0  # the bound, with slack for a shared machine
    assert nodes.fetches("timeout") == before + 1
    assert tokens == reference(ids)
    assert wait_for(lambda: free_blocks(nodes.fetcher) == nodes.fetcher.engine.num_blocks, timeout=10)


def test_a_holder_killed_mid_fetch_means_the_prefix_is_computed(nodes, reference, holder_process):
    ids = prompt(61, 45)
    nodes.warm(holder_process.address, ids)
    before = nodes.fetches("failed")
    # Frozen first, so that the fetch is under way (its reservation made, PushPrefix sent) when
    # the holder dies; the bound is long, so only the death can end the fetch early.
    os.kill(holder_process.pid, signal.SIGSTOP)
    out: dict = {}
    worker = threading.Thread(target=lambda: out.update(result=nodes.run(ids, holder_process.address, 20.0)))
    t0 = time.monotonic()
    try:
        worker.start()
        assert wait_for(lambda: len(nodes.fetcher.inbox.reservations) == 1, timeout=10)
        time.sleep(0.2)  # the PushPrefix call is on the wire
        os.kill(holder_process.pid, signal.SIGKILL)
    finally:
        holder_process.stop()
    worker.join(60)
    pre, tokens = out["result"]
    assert (pre.fetch_outcome, pre.cached_tokens) == ("failed", 0), pre
    assert time.monotonic() - t0 < 15.0 and pre.fetch_s < 15.0  # not the 20 s bound
    assert nodes.fetches("failed") == before + 1
    assert tokens == reference(ids)
    assert wait_for(lambda: free_blocks(nodes.fetcher) == nodes.fetcher.engine.num_blocks, timeout=10)


# ----------------------------------------------------------------------------- through the router
def test_the_next_turn_fetches_the_answer_from_the_decode_node(tiny_model, tok_dir, redis_url, reference):
    """A conversation's second turn repeats the first turn's prompt and answer. The decode node
    holds the answer's KV (it published the blocks of prompt + generated tokens), the prefill
    node only the prompt's: the router has the prefill node fetch the rest from the decode node.
    Greedy outputs equal a single engine's, with fetch on and with it off."""
    import pdserve
    from kv_index.client import redis_client
    from kv_index.reader import IndexReader

    ns = f"turns-{uuid.uuid4().hex[:6]}"
    kw = dict(redis_url=redis_url, namespace=ns, lease_s=1.0, heartbeat_s=0.1)
    prefill = start_node("prefill", "p0", node_engine_config(tiny_model), **kw)
    decode = start_node("decode", "d0", node_engine_config(tiny_model), **kw)
    routers = {on: start_router(redis_url, tok_dir, namespace=ns, max_model_len=512, short_prompt_tokens=16,
                                vocab_size=512, prefix_fetch=on)
               for on in (True, False)}
    reader = IndexReader(redis_client(redis_url), ns)
    m = prefill.metrics

    def fetched(outcome: str = "ok") -> float:
        return m.registry.get_sample_value("pdserve:kv_fetch_total", {**m.labels, "outcome": outcome}) or 0.0

    def outcomes() -> dict:
        return {o: fetched(o) for o in ("ok", "held", "failed", "timeout", "corrupt", "refused")}

    try:
        for on, seed in ((False, 71), (True, 73)):  # a conversation each: the prefill node lacks its answer
            first = prompt(seed, 40)
            with pdserve.Client(routers[on].address, timeout=60) as c:
                wait_for(c.health, timeout=20, every=0.1)
                # A long answer, so fetching it clearly beats computing it whatever the tiny model's
                # fitted speed (the router computes a short one instead: ~15 us a token against
                # a fetch's ~1.3 ms fixed cost, which is the right choice).
                answer = c.complete(token_ids=first, max_tokens=120, temperature=0.0, ignore_eos=True).token_ids
                turn = first + list(answer) + prompt(seed + 1, 9)
                # The decode node published the answer's blocks, the prefill node only the prompt's.
                hashes = hash_prompt_blocks(turn, BS, prefill.engine.fingerprint.encode())
                held = (len(first) + len(answer) - 1) // BS  # the last token's KV is never computed
                assert wait_for(lambda: reader.match(hashes, ["d0"])["d0"].blocks == held, timeout=10)
                assert reader.match(hashes, ["p0"])["p0"].blocks == len(first) // BS
                before = fetched()
                out = c.complete(token_ids=turn, max_tokens=8, min_tokens=8, temperature=0.0)
            assert list(out.token_ids) == reference(turn)
            assert fetched() == before + on, (outcomes(), out.usage)
            if on:
                assert out.usage.cached_prompt_tokens >= held * BS
    finally:
        for r in routers.values():
            r.stop()
        for n in (prefill, decode):
            n.stop(grace_s=0)
