"""A frozen decode node (SIGSTOP of its Ray actor's process: its sockets stay open, its kernel
still ACKs, nothing in it runs) on the embedded cluster with the router's default deadlines:
found within seconds, every stream goes on elsewhere with the fault-free tokens (greedy and
seeded), and once the node is continued (SIGCONT, right after the router gave up on it) none of
its late tokens reaches a client. The model is a tiny random one with SmolLM2's vocabulary,
decode steps slowed so the freeze lands mid-stream."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

import pdserve
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e
MAX_TOKENS = 40
STEP_DELAY_S = 0.05
TIMEOUT_S = 120.0
REQUESTS = [  # (token ids, sampling): long prompts go through the prefill node, short ones do not
    ([(i * 37) % 4000 + 100 for i in range(40)], {"temperature": 0.0}),
    ([(i * 53) % 4000 + 100 for i in range(8)], {"temperature": 0.0}),
    ([(i * 71) % 4000 + 100 for i in range(40)], {"temperature": 0.8, "top_p": 0.95, "seed": 7}),
    ([(i * 89) % 4000 + 100 for i in range(8)], {"temperature": 0.8, "top_p": 0.95, "seed": 8}),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from deploy.launcher import ClusterConfig, LocalCluster
    from engine.config import CacheConfig, EngineConfig
    from engine.models.tiny import save_tiny_chat_model

    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "chat", seed=3)
    config = ClusterConfig(engine=EngineConfig(model=str(model), dtype="float32", cache=CacheConfig(num_blocks=256)),
                           prefill_nodes=1, decode_nodes=2, grpc_port=0, http_port=None, dashboard_port=0,
                           namespace="freeze-test")
    with LocalCluster(config) as c:
        yield c


def run_streams(address: str) -> tuple[list[list[int]], list[BaseException], list[threading.Thread]]:
    """The requests as concurrent streams: their tokens as they arrive, errors, threads."""
    tokens: list[list[int]] = [[] for _ in REQUESTS]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        ids, sampling = REQUESTS[i]
        try:
            with pdserve.Client(address, timeout=TIMEOUT_S, retries=0) as c:
                with c.generate(token_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling) as stream:
                    for chunk in stream:
                        tokens[i].extend(chunk.token_ids)
        except BaseException as e:  # reported by the test
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(REQUESTS))]
    for t in threads:
        t.start()
    return tokens, errors, threads


def failures_detected(cluster) -> float:
    from telemetry.metrics import NODE_FAILURES

    reg = cluster.router.orchestrator.metrics.registry
    return sum(reg.get_sample_value("pdserve:router_node_failures_detected_total",
                                    {"model_name": cluster.config.engine.model, "reason": r}) or 0.0
               for r in NODE_FAILURES)


@pytest.fixture(scope="module")
def reference(cluster):
    """The fault-free run's tokens (decode steps slowed for every test of the module)."""
    decoders = [a for nid, a in cluster.actors.items() if nid.startswith("decode")]
    ray.get([a.set_step_delay.remote(STEP_DELAY_S) for a in decoders], timeout=30)
    tokens, errors, threads = run_streams(cluster.address)
    for t in threads:
        t.join(TIMEOUT_S)
    assert not errors, errors
    assert all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


def test_a_frozen_decode_node_is_detected_and_its_streams_finish_elsewhere_exactly(cluster, reference):
    decoders = {nid: a for nid, a in cluster.actors.items() if nid.startswith("decode")}
    got, errors, threads = run_streams(cluster.address)
    assert wait_for(lambda: all(len(t) >= 4 for t in got), timeout=60), got
    stats = {nid: ray.get(a.stats.remote(), timeout=30) for nid, a in decoders.items()}
    victim = max(stats, key=lambda nid: stats[nid]["running"])
    assert stats[victim]["running"] > 0
    pid, before = stats[victim]["pid"], failures_detected(cluster)
    os.kill(pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        detected = wait_for(lambda: failures_detected(cluster) > before, timeout=30, every=0.05)
        detect_s = time.monotonic() - frozen_at
    finally:
        os.kill(pid, signal.SIGCONT)  # at once: the woken node's late tokens must go nowhere
    for t in threads:
        t.join(TIMEOUT_S)
    print(f"frozen decode node detected in {detect_s:.2f} s")
    assert detected and detect_s < 15.0
    assert not errors, errors
    assert got == reference  # nothing lost, nothing twice, the same sampling draws
    migrated = cluster.router.orchestrator.metrics.registry.get_sample_value(
        "pdserve:request_migrations_total", {"model_name": cluster.config.engine.model, "reason": "decode_failed"})
    assert migrated >= stats[victim]["running"]


def test_a_frozen_prefill_node_is_given_up_on_and_the_prompt_recomputed(cluster, reference):
    """SIGSTOP of the prefill node, then the long prompts: placed there while its lease still
    holds, their Prefill calls fail (keepalive, else the Prefill deadline) and the decode nodes
    compute the prompts themselves."""
    from telemetry.metrics import NODE_FAILURES

    pid = ray.get(cluster.actors["prefill-0"].stats.remote(), timeout=30)["pid"]
    reg = cluster.router.orchestrator.metrics.registry
    model = cluster.config.engine.model

    def prefill_failed() -> float:
        return reg.get_sample_value("pdserve:request_migrations_total",
                                    {"model_name": model, "reason": "prefill_failed"}) or 0.0

    before, detected_before = prefill_failed(), failures_detected(cluster)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        got, errors, threads = run_streams(cluster.address)
        for t in threads:
            t.join(TIMEOUT_S)
        elapsed = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    print(f"streams with a frozen prefill node done in {elapsed:.2f} s; node failures by reason: "
          + str({r: reg.get_sample_value("pdserve:router_node_failures_detected_total",
                                         {"model_name": model, "reason": r}) for r in NODE_FAILURES}))
    assert not errors, errors
    assert got == reference
    assert prefill_failed() > before and failures_detected(cluster) > detected_before
    assert elapsed < 30.0
