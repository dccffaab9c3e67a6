"""Tensor-parallel nodes in a cluster on real Ray (node actors, their worker ranks as child
processes on a gloo group), real Redis, real gRPC and the router, on the tiny random model
(4 attention heads, 2 KV heads: TP 2 splits both) on CPU:

- a TP 2 prefill node sends its KV, gathered with all its heads, to a TP 2 decode node, which
  lands it full-head and scatters it into its ranks' pools (engine/parallel/kv_regroup.py
  LandingArea); the greedy output equals one TP 1 engine's;
- when one of the TP 2 decode node's ranks is SIGKILLed mid-stream the node fails as a whole:
  the stream migrates to a TP 1 decode node (its KV again from the TP 2 prefill node) and
  completes with the same tokens;
- a TP 2 decode node whose landing area is full refuses a reservation over gRPC with
  RESOURCE_EXHAUSTED and a retry hint, and the router prefills on the decode node instead.

Which transport carries the KV here is shm (one host); dist and tcp between TP sizes are the
in-process test's.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
import uuid

import pytest

import pdserve
from tests.helpers import node_engine_config, prompt, wait_for

ray = pytest.importorskip("ray")

MAX_TOKENS = 24
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_ray():
    from tests.clusters import ray_pools

    # CPUs: the TP 2 prefill node and the TP 2 decode node ask for one per rank.
    yield from ray_pools(1, 3, num_cpus=4, prefix="tp")


@pytest.fixture(scope="module")
def reference(tiny_dir):
    from engine.engine import LLMEngine
    from tokens.sampling_params import SamplingParams

    engine = LLMEngine(node_engine_config(tiny_dir), load_tokenizer=False)

    def run(ids, params: SamplingParams | None = None):
        out = engine.generate([ids], params or SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))
        return list(out[0].outputs[0].token_ids)

    return run


def _spawn(node_id: str, role: str, tp: int, common: dict, **fields):
    from tests.clusters import spawn_actor

    return spawn_actor(role, node_id, tensor_parallel=tp, **common, **fields)


def _scrape(metrics_address: str, name: str) -> float:
    body = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name))


def _worker_pids(pid: int) -> list[int]:
    """The TP worker ranks among a node actor's child processes (/proc, any thread's children)."""
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(x) for x in f.read().split()]
    out = []
    for k in kids:
        try:
            with open(f"/proc/{k}/cmdline", "rb") as f:
                if b"engine.parallel.worker" in f.read():
                    out.append(k)
        except FileNotFoundError:
            pass
    return out


def _sees(router, *node_ids: str) -> bool:
    return {n.node_id for n in router.orchestrator.refresher.view.nodes} == set(node_ids)


def _generate(client, ids, tokens: list | None = None) -> list[int]:
    tokens = [] if tokens is None else tokens
    with client.generate(token_ids=ids, max_tokens=MAX_TOKENS, **GREEDY) as stream:
        for chunk in stream:
            tokens.extend(chunk.token_ids)
        assert stream.completion.finish_reason == "length"
    return tokens


def test_tp_nodes_exchange_kv_and_a_dead_rank_fails_the_node_and_its_stream_migrates(
        tp_ray, tiny_dir, tok_dir, redis_url, reference):
    from tests.clusters import start_router

    ns = f"tp-{uuid.uuid4().hex[:6]}"
    common = dict(redis_url=redis_url, namespace=ns, lease_s=1.5, heartbeat_s=0.2, load_tokenizer=False,
                  engine=node_engine_config(tiny_dir, num_blocks=128), max_step_failures=1, max_start_failures=1)
    actors = {"prefill-0": _spawn("prefill-0", "prefill", 2, common, kv_dist=True),
              "decode-0": _spawn("decode-0", "decode", 2, common, kv_dist=True)}
    router = start_router(redis_url, tok_dir, namespace=ns, max_model_len=512, short_prompt_tokens=8, vocab_size=512)
    client = pdserve.Client(router.address, timeout=60, retries=0)
    try:
        assert ray.get([a.ready.remote() for a in actors.values()], timeout=120) == [True, True]
        assert wait_for(lambda: _sees(router, "prefill-0", "decode-0"), timeout=20, every=0.1)
        prefill, decode0 = ray.get([actors[n].stats.remote() for n in ("prefill-0", "decode-0")], timeout=30)
        assert len(_worker_pids(prefill["pid"])) == 1  # rank 1 of 2
        (rank1,) = _worker_pids(decode0["pid"])

        # TP 2 -> TP 2: gathered from the prefill node's ranks, landed full-head and scattered
        # into the decode node's (on one host shm carries it; dist and tcp: the test below).
        ids = prompt(1, 40)
        assert _generate(client, ids) == reference(ids)
        stats = ray.get([actors[n].stats.remote() for n in ("prefill-0", "decode-0")], timeout=30)
        assert [s["transfer_failures"] for s in stats] == [0, 0] and stats[0]["prefills"] == 1
        assert _scrape(stats[1]["metrics_address"], "pdserve:kv_transfer_bytes_total") > 0

        # Mid-stream, a TP 1 decode node joins, then decode-0's rank 1 dies: the stream moves to
        # decode-2, its prompt prefilled again on the TP 2 prefill node (TP 2 -> TP 1).
        ray.get(actors["decode-0"].set_step_delay.remote(1.0), timeout=30)  # outlasts the next spawn
        ids = prompt(3, 40)
        tokens: list[int] = []
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("out", _generate(client, ids, tokens)), daemon=True)
        t.start()
        actors["decode-2"] = _spawn("decode-2", "decode", 1, common)
        assert ray.get(actors["decode-2"].ready.remote(), timeout=120)
        assert wait_for(lambda: _sees(router, "prefill-0", "decode-0", "decode-2"), timeout=20, every=0.1)
        assert wait_for(lambda: len(tokens) >= 2, timeout=30)
        assert len(tokens) < MAX_TOKENS, "the stream ended before the fault: raise the step delay"
        os.kill(rank1, signal.SIGKILL)
        t.join(60)
        assert box.get("out") == reference(ids)
        decode2 = ray.get(actors["decode-2"].stats.remote(), timeout=30)
        assert decode2["decodes"] >= 1 and decode2["transfer_failures"] == 0
        # The TP 2 node failed as a whole: its health record names the rank.
        from kv_index.client import redis_client
        from kv_index.health import HealthStore

        def recorded() -> str:
            rec = HealthStore(redis_client(redis_url), ns).read("decode-0")
            return str(rec)

        assert wait_for(lambda: "tensor-parallel" in recorded(), timeout=20, every=0.2), recorded()
    finally:
        client.close()
        router.stop()
        for a in actors.values():
            ray.kill(a, no_restart=True)
        time.sleep(0.5)


def test_a_tp1_prefill_node_streams_into_a_tp2_decode_node_over_dist_and_tcp(tiny_dir, tok_dir, redis_url,
                                                                            reference):
    """In this process (so the test picks the prefill node's transports, as on two hosts where
    shm does not apply): TP 1 -> TP 2, the KV streamed layer by layer lands full-head and each
    rectangle is scattered into both ranks' pools; over dist, then over tcp."""
    prefill_tp, decode_tp = 1, 2
    from kv_transfer.dist_transport import DistKVSender
    from kv_transfer.grpc_transport import GrpcKVSender
    from kv_transfer.tcp_transport import TcpKVSender
    from kv_transfer.transport import FallbackKVSender
    from tests.clusters import start_node, start_router

    ns = f"tpin-{uuid.uuid4().hex[:6]}"
    eng = node_engine_config(tiny_dir, num_blocks=128)
    common = dict(redis_url=redis_url, namespace=ns, lease_s=1.5, heartbeat_s=0.2, grpc_workers=8)
    prefill = start_node("prefill", "prefill-0", eng, tensor_parallel=prefill_tp, **common)
    decode = start_node("decode", "decode-0", eng, kv_dist=True, tensor_parallel=decode_tp, **common)
    router = start_router(redis_url, tok_dir, namespace=ns, max_model_len=512, short_prompt_tokens=8, vocab_size=512)
    client = pdserve.Client(router.address, timeout=60, retries=0)
    try:
        tp_node = prefill if prefill_tp > 1 else decode
        assert tp_node.tp is not None and len(tp_node.tp.kv_pools) == 2
        assert prefill.kv_streaming is (prefill_tp == 1)  # a TP 1 sender streams layer by layer
        landing = decode.inbox.landing
        assert (landing is None) is (decode_tp == 1)
        assert wait_for(lambda: _sees(router, "prefill-0", "decode-0"), timeout=20, every=0.1)
        dist = DistKVSender()
        for i, fast in enumerate(([dist, TcpKVSender()], [TcpKVSender()])):
            prefill.kv_sender.close()
            prefill.kv_sender = FallbackKVSender(fast, GrpcKVSender())
            ids = prompt(10 + i, 40)
            assert _generate(client, ids) == reference(ids)
            assert prefill.num_prefills == i + 1 and prefill.num_transfer_failures == 0
            assert prefill.kv_sender.num_fallbacks == 0 and decode.num_transfer_failures == 0
        assert dist.groups_made == 1  # the first push went over dist
        if landing is not None:  # every slot back once the requests took their KV
            assert landing.free_slots == landing.tensor.shape[1]
    finally:
        client.close()
        router.stop()
        for s in (prefill, decode):
            s.stop(grace_s=0)
    assert tp_node.tp.workers.procs[0].poll() is not None  # the node's stop closed its rank


def test_a_size_that_does_not_divide_the_heads_is_refused_when_the_node_starts(tiny_dir, redis_url):
    """What the node actor's start guard records (node/start_guard.py): the reason, naming the
    model's heads and the sizes that fit; no worker is started for it."""
    from engine.parallel.plan import TensorParallelError
    from node.config import NodeConfig
    from prefill_node.server import PrefillServer

    cfg = NodeConfig(node_id="prefill-0", role="prefill", redis_url=redis_url, load_tokenizer=False,
                     engine=node_engine_config(tiny_dir), tensor_parallel=3)
    with pytest.raises(TensorParallelError, match=r"size 3 does not divide .*4 attention heads and 2 KV heads.*1, 2 fit"):
        PrefillServer(cfg)


def test_a_tp2_prefill_node_fetches_a_prefix_from_a_tp2_holder_and_sends_over_dist_to_a_tp1_decode_node(
        tiny_dir, redis_url, reference):
    """Prefix fetch between TP nodes: the holder gathers the prefix from its ranks (tcp), the
    fetching prefill node lands it full-head and scatters it to its ranks, computes the rest and
    sends the prompt's KV, gathered again, over dist to a TP 1 decode node."""
    from kv_transfer.dist_transport import DistKVSender
    from kv_transfer.grpc_transport import GrpcKVSender
    from kv_transfer.tcp_transport import TcpKVSender
    from kv_transfer.transport import FallbackKVSender
    from tests.clusters import start_node
    from tests.test_prefix_fetch import GREEDY as FETCH_GREEDY
    from tests.test_prefix_fetch import Nodes

    class TPNodes(Nodes):  # test_prefix_fetch's holder, fetcher and decode node, at these sizes
        def __init__(self) -> None:
            self.ns = f"tpfetch-{uuid.uuid4().hex[:6]}"
            kw = dict(redis_url=redis_url, namespace=self.ns, lease_s=1.5, heartbeat_s=0.2, grpc_workers=8)
            eng = node_engine_config(tiny_dir, num_blocks=128)
            self.holder = start_node("prefill", "h0", eng, tensor_parallel=2, **kw)
            self.fetcher = start_node("prefill", "p0", eng, tensor_parallel=2, **kw)
            self.decode = start_node("decode", "d0", eng, kv_dist=True, **kw)
            self.fp = self.fetcher.engine.fingerprint
            self._channels = {}

    nodes = TPNodes()
    try:
        for node, fast in ((nodes.holder, [TcpKVSender()]), (nodes.fetcher, [DistKVSender(), TcpKVSender()])):
            node.kv_sender.close()
            node.kv_sender = FallbackKVSender(fast, GrpcKVSender())
        ids = prompt(21, 45)
        n = (len(ids) - 1) // 4
        nodes.warm(nodes.holder.address, ids)
        pre, tokens = nodes.run(ids, nodes.holder.address)
        assert (pre.fetch_outcome, pre.fetch_blocks, pre.fetch_transport) == ("ok", n, "tcp"), pre
        assert pre.cached_tokens == n * 4 and pre.transport == "dist"
        assert tokens == reference(ids, FETCH_GREEDY)
        landing = nodes.fetcher.inbox.landing
        assert landing.free_slots == landing.tensor.shape[1]  # the fetch's slots came back
    finally:
        nodes.close()


def test_a_full_landing_area_answers_resource_exhausted_with_a_retry_hint_and_the_router_recomputes(
        tiny_dir, tok_dir, redis_url, reference, caplog):
    """A TP 2 decode node whose landing area has room for one prompt (engine/parallel/kv_regroup.py
    landing_slots: max_model_len 64 at 4-token blocks, 32-block pool: 16 slots) holds a
    reservation of 9 slots taken over the real wire. The next ReserveBlocks, over gRPC, is
    refused with RESOURCE_EXHAUSTED and the node's retry hint while the engine's pool still has
    room, and takes nothing; a request through the router meets the same refusal, which the
    router reports and answers by prefilling on the decode node (same tokens). Once the held
    reservation is released the next request is disaggregated again and every slot comes back."""
    import logging

    import grpc

    from decode_node.server import RETRY_AFTER_MS
    from protos.conventions import retry_after_ms
    from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
    from tests.clusters import start_node, start_router

    ns = f"tpfull-{uuid.uuid4().hex[:6]}"
    from engine.config import SchedulerConfig
    from tests.helpers import engine_config

    eng = engine_config(tiny_dir, block_size=4, num_blocks=32,
                        scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8, max_model_len=64))
    common = dict(redis_url=redis_url, namespace=ns, lease_s=1.5, heartbeat_s=0.2, grpc_workers=8)
    prefill = start_node("prefill", "prefill-0", eng, **common)
    decode = start_node("decode", "decode-0", eng, tensor_parallel=2, reservation_lease_s=60.0, **common)
    router = start_router(redis_url, tok_dir, namespace=ns, max_model_len=512, short_prompt_tokens=8, vocab_size=512)
    client = pdserve.Client(router.address, timeout=60, retries=0)
    channel = grpc.insecure_channel(decode.address)
    kv = kv_pb2_grpc.KVTransferStub(channel)

    def reserve(rid: str, ids: list[int]):
        return kv.ReserveBlocks(kv_pb2.ReserveBlocksRequest(
            request_id=rid, model_fingerprint=decode.engine.fingerprint, block_size=decode.engine.block_size,
            num_tokens=len(ids), prompt_token_ids=ids), timeout=30)

    try:
        landing = decode.inbox.landing
        slots = landing.tensor.shape[1]
        assert slots == 16 and decode.engine.num_blocks == 32
        assert wait_for(lambda: _sees(router, "prefill-0", "decode-0"), timeout=20, every=0.1)

        held = reserve("held-0", prompt(30, 36))  # 9 blocks: 7 landing slots left, 23 pool blocks
        assert len(held.block_ids) == 9 and landing.free_slots == slots - 9
        with pytest.raises(grpc.RpcError) as refused:
            reserve("refused-1", prompt(31, 36))
        err = refused.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert retry_after_ms(err.trailing_metadata()) == RETRY_AFTER_MS
        assert "landing area" in err.details()
        # The refusal took nothing: no reservation, no slot (its engine blocks went back).
        assert decode.reservations.get("refused-1") is None and landing.free_slots == slots - 9
        assert len(decode.reservations) == 1

        # Through the router: its ReserveBlocks is refused the same way; it says so and
        # prefills on the decode node instead (short prompts do that anyway).
        ids = prompt(32, 36)
        # DEBUG: a refusal within the rate limit's window of an earlier one is logged there.
        with caplog.at_level(logging.DEBUG, logger="router.orchestrator"):
            assert _generate(client, ids) == reference(ids)
        assert any("ReserveBlocks" in r.getMessage() and "RESOURCE_EXHAUSTED" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert prefill.num_prefills == 0 and decode.num_decodes == 1

        # Room again: disaggregated, the KV pushed into the landing area and scattered.
        assert kv.ReleaseReservation(kv_pb2.ReleaseReservationRequest(request_id="held-0"), timeout=30).found
        assert landing.free_slots == slots
        ids = prompt(33, 36)
        assert _generate(client, ids) == reference(ids)
        assert prefill.num_prefills == 1 and prefill.num_transfer_failures == 0
        assert decode.num_transfer_failures == 0 and decode.num_decodes == 2
        assert wait_for(lambda: landing.free_slots == slots, timeout=10, every=0.05)
    finally:
        channel.close()
        client.close()
        router.stop()
        for s in (prefill, decode):
            s.stop(grace_s=0)
