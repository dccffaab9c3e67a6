"""Node failures mid-request, against real Redis, real gRPC node servers (tiny random model on
CPU, in this process) and the router: the client's streams go on with nothing lost or
duplicated, and greedy and seeded outputs equal a run without the fault.

A node is killed the way a crash looks from outside: its gRPC server stops at once (every
open call ends), its engine stops, and its registry entry is left to expire with the lease.
Decode steps are slowed (AsyncEngine.step_delay_s, a fault hook that only the node's own
process can set) so that the kill lands mid-stream on every run, not by luck.
"""
from __future__ import annotations

import pytest

import pdserve
from tests import migration_harness
from tests.helpers import prompt
from tests.migration_harness import DEADLINE_S, three_node_cluster

MAX_TOKENS = 32
REQUESTS = migration_harness.requests(presence_penalty=0.5)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return migration_harness.reference_run(tiny_model, MAX_TOKENS)


@pytest.fixture
def cluster(redis_url, tok_dir, tiny_model):
    """prefill-0, decode-0, decode-1 and a router in a fresh namespace; torn down after each test."""
    yield from make_cluster(redis_url, tok_dir, tiny_model)


def make_cluster(redis_url, tok_dir, model):
    return three_node_cluster(redis_url, tok_dir, model, prefix="fault")


class Streams(migration_harness.Streams):
    requests, max_tokens = REQUESTS, MAX_TOKENS


def crash(server) -> None:
    """As a dead process looks from outside: calls cut, engine gone, lease left to expire."""
    server.stop(deregister=False, grace_s=0)


def migrations(router, reason: str) -> float:
    return router.orchestrator.metrics.registry.get_sample_value(
        "pdserve:request_migrations_total", {"model_name": "m", "reason": reason}) or 0.0


def assert_exact(streams: Streams, reference) -> None:
    streams.assert_exact(reference, finish="length")


def test_kill_decode_mid_stream_migrates_with_identical_output(cluster, reference):
    router, nodes = cluster
    for nid in ("decode-0", "decode-1"):
        nodes[nid].aengine.step_delay_s = 0.05
    streams = Streams(router.address)
    streams.wait_until(lambda: all(len(t) >= 3 for t in streams.tokens), "3 tokens on every stream")
    # The decode node serving more of the streams dies; each of its streams is mid-way.
    victim = max(("decode-0", "decode-1"), key=lambda n: nodes[n].aengine.load.running)
    assert nodes[victim].aengine.load.running > 0
    crash(nodes[victim])
    streams.join()
    assert_exact(streams, reference)
    assert migrations(router, "decode_failed") >= 1
    assert migrations(router, "gave_up") == 0


def test_kill_prefill_mid_prefill_is_placed_again(cluster, reference):
    router, nodes = cluster
    prefill = nodes["prefill-0"]
    prefill.aengine.step_delay_s = 2.0  # holds each prefill long enough to die in it
    for nid in ("decode-0", "decode-1"):
        nodes[nid].aengine.step_delay_s = 0.01
    streams = Streams(router.address)
    streams.wait_until(lambda: prefill.inflight.count > 0, "a prefill in progress")
    crash(prefill)
    streams.join()
    assert_exact(streams, reference)
    assert migrations(router, "prefill_failed") >= 1


def bytes_written(node) -> float:
    m = node.metrics
    return m.registry.get_sample_value("pdserve:kv_transfer_bytes_total", m.labels) or 0.0


@pytest.mark.parametrize("mode", ["flip", "cut"])
def test_corrupt_kv_is_detected_recomputed_and_never_written(cluster, reference, mode):
    router, nodes = cluster
    prefill = nodes["prefill-0"]
    # The only prefill node damages every transfer it makes (prefill_node/faults.py).
    prefill.set_kv_fault(mode)
    faulty = prefill.kv_sender
    decoders = [nodes["decode-0"], nodes["decode-1"]]
    streams = Streams(router.address)
    streams.join()
    assert_exact(streams, reference)
    assert faulty.pushes >= 1  # the long prompts went through it
    assert sum(d.num_transfer_failures for d in decoders) == faulty.pushes  # every one refused
    assert sum(bytes_written(d) for d in decoders) == 0  # nothing written
    assert migrations(router, "prefill_failed") == 0  # a refused transfer is not a dead node
    prefill.set_kv_fault(None)
    again = Streams(router.address)
    again.join()
    assert_exact(again, reference)
    assert sum(bytes_written(d) for d in decoders) > 0  # healthy transfers are written again


def test_redis_restart_keeps_serving_and_the_index_is_rebuilt(tok_dir, tiny_model, reference):
    import redis

    from deploy.redis_server import RedisServer
    from kv_index.reader import IndexReader
    from tokens.block_hash import hash_prompt_blocks

    server = RedisServer().start()
    try:
        gen = make_cluster(server.url, tok_dir, tiny_model)
        router, nodes = next(gen)
        try:
            ns = router.orchestrator.config.namespace
            reader = IndexReader(redis.Redis.from_url(server.url), ns)
            view = router.orchestrator.refresher.view
            long_prompt = REQUESTS[0][0]
            hashes = hash_prompt_blocks(long_prompt, view.block_size, view.fingerprint.encode())
            first = Streams(router.address)
            first.join()
            assert_exact(first, reference)

            def cached_somewhere() -> bool:
                try:
                    return max(m.blocks for m in reader.match(hashes, list(nodes)).values()) > 0
                except redis.RedisError:
                    return False

            first.wait_until(cached_somewhere, "the prompt's blocks in the index")
            server.stop()  # Redis gone: the router places on the nodes it last read, without the index
            during = Streams(router.address)
            during.join()
            assert_exact(during, reference)
            assert "registry unreadable" in (router.orchestrator.refresher.view.error or "")
            # Back, empty (same port and password): the nodes register again and resync the index.
            server = RedisServer(port=server.port, password=server.password).start()
            reader = IndexReader(redis.Redis.from_url(server.url), ns)
            during.wait_until(lambda: set(reader.live_nodes()) == set(nodes), "every node registered again")
            view = router.orchestrator.refresher
            during.wait_until(lambda: not view.view.error and len(view.view.nodes) == len(nodes), "the router's view")
            during.wait_until(cached_somewhere, "the index rebuilt from the nodes' snapshots")
            after = Streams(router.address)
            after.join()
            assert_exact(after, reference)
        finally:
            next(gen, None)
    finally:
        server.stop()


def test_a_request_that_cannot_move_ends_with_the_nodes_error(cluster):
    # n = 2: the samples forked at the first output token, which a continuation cannot redo.
    router, nodes = cluster
    for nid in ("decode-0", "decode-1"):
        nodes[nid].aengine.step_delay_s = 0.05
    got: list[int] = []
    crashed: list[bool] = []
    with pdserve.Client(router.address, timeout=DEADLINE_S, retries=0) as c:
        with pytest.raises(pdserve.UnavailableError, match="decode node decode-"):
            with c.generate(token_ids=prompt(5, 20), max_tokens=MAX_TOKENS, n=2, temperature=0.0,
                            ignore_eos=True) as stream:
                for chunk in stream:
                    got.extend(chunk.token_ids)
                    if len(got) >= 4 and not crashed:
                        crashed.append(True)
                        crash(next(n for n in nodes.values() if n.role.value == "decode"
                                   and n.aengine.load.running > 0))
    assert 4 <= len(got) < 2 * MAX_TOKENS
    assert migrations(router, "gave_up") == 1
