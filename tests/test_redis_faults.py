"""A Redis that hangs, or restarts from its append-only file, against the real clients, a real
node publisher and a real cluster (tiny random model on CPU, nodes and router in this process).

Faults are real and undone in ``finally``: a listener whose accept queue is full (a connect that
never completes), redis-server stopped with SIGSTOP (``RedisServer.frozen``, always resumed), and
SIGKILL then a restart from the append-only file. Each test starts a Redis of its own: freezing
the session's would stall every other test.
"""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
import uuid
from urllib.parse import quote

import pytest
import redis

import pdserve
from deploy.redis_server import RedisServer
from kv_index.client import RedisTimeouts, redis_client
from kv_index.events import BlockStored
from kv_index.nodes import NodeInfo
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from kv_index.schema import node_holdings
from node.publisher import IndexPublisherThread
from tests.clusters import start_node, start_router
from tests.helpers import engine_config, prompt, wait_for
from tokens.block_hash import hash_prompt_blocks

MAX_TOKENS = 16
BOUND_S = 15.0  # a wait in these tests; the measured figures are in docs/cluster.md


# ---------------------------------------------------------------------- the clients
def test_connect_timeout_bounds_a_redis_that_never_accepts():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # room for one connection, never accepted: later SYNs are dropped
        port = listener.getsockname()[1]
        held = socket.create_connection(("127.0.0.1", port), timeout=1.0)
        try:
            client = redis_client(f"redis://127.0.0.1:{port}/0", RedisTimeouts(connect_s=0.3, reply_s=30.0))
            t0 = time.monotonic()
            with pytest.raises(redis.TimeoutError):
                client.ping()
            assert time.monotonic() - t0 < 5.0  # the connect bound, not the reply bound
        finally:
            held.close()


def test_reply_timeout_bounds_a_frozen_redis_and_the_client_recovers():
    with RedisServer() as server:
        client = redis_client(server.url, RedisTimeouts(connect_s=0.3, reply_s=0.3))
        assert client.ping()
        with server.frozen():
            t0 = time.monotonic()
            with pytest.raises(redis.TimeoutError):
                client.ping()
            assert time.monotonic() - t0 < 5.0
        assert client.ping()  # the timed-out connection was dropped, not reused mid-reply


# ---------------------------------------------------------------------- a node's publisher
def test_the_publisher_rides_out_a_frozen_redis_and_resyncs():
    with RedisServer() as server:
        ns = f"hang-{uuid.uuid4().hex[:6]}"
        client = redis_client(server.url, RedisTimeouts(connect_s=0.3, reply_s=0.3))
        info = NodeInfo("decode-0", "decode", "127.0.0.1:1", "fp", 16, 64)
        thread = IndexPublisherThread(NodePublisher(client, info, ns, lease_s=1.0), lambda: {"running": 1},
                                      heartbeat_s=0.1, max_batches=8)
        reader = IndexReader(redis_client(server.url), ns)
        try:
            with server.frozen():
                t0 = time.monotonic()
                thread.start()  # registers once Redis answers: the node serves meanwhile
                assert time.monotonic() - t0 < 5.0
                t0 = time.monotonic()
                for h in range(1, 101):  # the engine's hand-overs: queued and folded, never waited on
                    thread.submit_events([BlockStored((h,), None, ())])
                assert time.monotonic() - t0 < 1.0
                assert wait_for(lambda: thread.num_failures >= 2, timeout=BOUND_S)
                assert thread.queued_batches <= 9
            assert wait_for(lambda: reader.match([100], ["decode-0"])["decode-0"].blocks == 1, timeout=BOUND_S)
            assert "decode-0" in reader.live_nodes()
            assert sorted(node_holdings(client, ns, "decode-0")[2]) == list(range(1, 101))
            assert thread.num_resyncs >= 1
        finally:
            with server.frozen():  # leaving the index on a hung Redis is bounded too
                t0 = time.monotonic()
                thread.stop()
                assert time.monotonic() - t0 < 10.0


def test_a_redis_that_refuses_the_node_still_fails_its_start(redis_server):
    # A wrong password is a configuration error, not an outage: the node must not serve unregistered.
    url = redis_server.url.replace(quote(redis_server.password, safe=""), "wrong")
    info = NodeInfo("decode-0", "decode", "127.0.0.1:1", "fp", 16, 64)
    thread = IndexPublisherThread(NodePublisher(redis_client(url), info, "refused"), dict, heartbeat_s=0.1)
    with pytest.raises(redis.AuthenticationError):
        thread.start()


# ---------------------------------------------------------------------- a cluster
@pytest.fixture(scope="module")
def reference(tiny_model):
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from tokens.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=tiny_model, device="cpu", num_threads=1), load_tokenizer=False)

    def run(ids):
        out = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0))
        return list(out[0].outputs[0].token_ids)

    return run


@pytest.fixture(scope="module")
def aof_cluster(tok_dir, tiny_model):
    """A Redis of its own keeping an append-only file, prefill-0, decode-0 and a router with HTTP.

    prefill-0 heartbeats every 30 s (its lease 60 s): after Redis comes back it resyncs only on
    its next event or heartbeat, so a request can meet the index Redis reloaded, stale, first.
    decode-0 heartbeats every 0.2 s with a 1.5 s lease: a freeze of a few seconds outlives it."""
    server = RedisServer(appendonly=True).start()
    ns = f"aof-{uuid.uuid4().hex[:6]}"
    eng = engine_config(tiny_model, num_blocks=128)
    nodes = {}
    router = None
    try:
        nodes["prefill-0"] = start_node("prefill", "prefill-0", eng, redis_url=server.url, namespace=ns,
                                        lease_s=60.0, heartbeat_s=30.0, grpc_workers=8)
        nodes["decode-0"] = start_node("decode", "decode-0", eng, redis_url=server.url, namespace=ns,
                                       lease_s=1.5, heartbeat_s=0.2, grpc_workers=8)
        router = start_router(server.url, tok_dir, namespace=ns, http_port=0, max_model_len=512, short_prompt_tokens=32,
                              vocab_size=512)
        assert wait_for(lambda: len(router.orchestrator.refresher.view.nodes) == 2, timeout=BOUND_S)
        yield server, router, nodes, ns
    finally:
        if router is not None:
            router.stop()
        for s in nodes.values():
            s.stop(grace_s=0)
        server.stop()


def generate(address: str, ids: list[int], request_id: str | None = None) -> list[int]:
    with pdserve.Client(address, timeout=60.0, retries=0) as c:
        with c.generate(token_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0,
                        request_id=request_id) as stream:
            return [t for chunk in stream for t in chunk.token_ids]


def get_json(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, json.loads(r.read())


def metric(router, short: str) -> float:
    return router.orchestrator.metrics.registry.get_sample_value(f"pdserve:{short}", {"model_name": "m"}) or 0.0


def test_a_frozen_redis_degrades_the_router_which_keeps_serving(aof_cluster, reference):
    server, router, nodes, ns = aof_cluster
    refresher = router.orchestrator.refresher
    ready_url = f"http://{router.http_address}/ready"
    assert wait_for(lambda: refresher.degraded is None, timeout=BOUND_S)
    assert get_json(ready_url) == (200, {"ready": True, "reason": "1 prefill and 1 decode nodes live",
                                         "degraded": False, "degraded_reason": ""})
    prompts = [prompt(20 + i, 48 if i % 2 else 20) for i in range(4)]  # disaggregated and local
    expected = [reference(p) for p in prompts]
    latencies: list[float] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                got = generate(router.address, prompts[i % len(prompts)])
                assert got == expected[i % len(prompts)]
            except BaseException as e:  # reported below
                errors.append(e)
                return
            latencies.append(time.monotonic() - t0)
            i += 2

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        with server.frozen():
            frozen_at = time.monotonic()
            assert wait_for(lambda: refresher.degraded is not None, timeout=BOUND_S)
            status, body = get_json(ready_url)
            assert status == 200 and body["ready"] and body["degraded"] and body["degraded_reason"]
            assert metric(router, "router_degraded") == 1.0
            served_before = len(latencies)
            time.sleep(max(0.0, frozen_at + 4.0 - time.monotonic()))  # past decode-0's 1.5 s lease
            served_frozen = len(latencies) - served_before
        thawed_at = time.monotonic()
        assert wait_for(lambda: refresher.degraded is None, timeout=BOUND_S), refresher.degraded
        recovered_s = time.monotonic() - thawed_at
        time.sleep(0.5)  # requests across the recovery too
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert served_frozen >= 2 and max(latencies) < BOUND_S
    assert metric(router, "index_lookup_failures_total") + metric(router, "index_lookups_skipped_total") >= 1
    assert get_json(ready_url)[1]["degraded"] is False and metric(router, "router_degraded") == 0.0
    assert recovered_s < BOUND_S
    # decode-0's lease ran out while Redis was frozen: it registered again (kept in the view meanwhile).
    reader = IndexReader(redis_client(server.url), ns)
    assert set(reader.live_nodes()) == {"prefill-0", "decode-0"}


def test_a_redis_restarted_from_a_stale_append_only_file_costs_misses_not_answers(aof_cluster, reference):
    server, router, nodes, ns = aof_cluster
    refresher, accuracy = router.orchestrator.refresher, router.orchestrator.accuracy
    prefill, decode = nodes["prefill-0"], nodes["decode-0"]
    reader = IndexReader(redis_client(server.url), ns)
    kept, dropped = prompt(41, 80), prompt(42, 80)  # disaggregated (>= 32 tokens)
    view = refresher.view
    hashes = {id(p): hash_prompt_blocks(p, view.block_size, view.fingerprint.encode()) for p in (kept, dropped)}

    def held_by_prefill(p) -> int:
        return reader.match(hashes[id(p)], ["prefill-0"])["prefill-0"].blocks

    assert wait_for(lambda: refresher.degraded is None, timeout=BOUND_S)
    for p in (kept, dropped):
        assert generate(router.address, p) == reference(p)
    assert wait_for(lambda: held_by_prefill(kept) == held_by_prefill(dropped) == 5, timeout=BOUND_S)

    server.kill()  # a crash: the append-only file keeps the index as it was
    failures = prefill.publisher.num_failures
    for node in (prefill, decode):  # what the nodes hold changes while Redis is gone
        assert node.aengine.run(lambda e: e.kv.reset_prefix_cache())
    assert wait_for(lambda: prefill.publisher.num_failures > failures, timeout=BOUND_S)
    resyncs = prefill.publisher.num_resyncs
    decode_resyncs = decode.publisher.num_resyncs
    server.start()
    reader = IndexReader(redis_client(server.url), ns)
    assert held_by_prefill(kept) == held_by_prefill(dropped) == 5  # reloaded, and wrong: prefill-0 holds nothing
    assert wait_for(lambda: refresher.degraded is None, timeout=BOUND_S), refresher.degraded
    assert wait_for(lambda: decode.publisher.num_resyncs > decode_resyncs, timeout=BOUND_S)  # decode-0: empty
    assert prefill.publisher.num_resyncs == resyncs  # prefill-0 has not noticed yet: the index is stale

    rid = f"stale-{uuid.uuid4().hex[:6]}"
    assert generate(router.address, kept, request_id=rid) == reference(kept)  # a miss, the same answer
    predicted, reused = accuracy.recent[rid]
    assert predicted > 0 and reused == 0  # placed on the stale claim, recomputed there
    # prefill-0's new blocks woke its publisher: it resynced from its snapshot; the stale entries went.
    assert wait_for(lambda: prefill.publisher.num_resyncs > resyncs, timeout=BOUND_S)
    assert wait_for(lambda: held_by_prefill(dropped) == 0 and held_by_prefill(kept) == 5, timeout=BOUND_S)
    rid = f"fresh-{uuid.uuid4().hex[:6]}"
    assert generate(router.address, kept, request_id=rid) == reference(kept)
    predicted, reused = accuracy.recent[rid]
    assert predicted > 0 and reused > 0  # a hit again (the engine keeps the last prompt token to compute)
