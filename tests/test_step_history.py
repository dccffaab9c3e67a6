"""Slow decode nodes judged against their own recent speed (router/step_history.py and
placement's without_stragglers): plain data, time passed in."""
from __future__ import annotations

from dataclasses import replace

import pytest

from kv_index.nodes import NodeInfo
from router.config import RouterConfig
from router.cost_model import CostBook
from router.node_view import NodeRefresher
from router.placement import PlacementRequest, PrefixLoadPolicy, TtftPolicy, without_stragglers
from router.step_history import MIN_SAMPLES, WINDOW_S, StepHistory, batch_bucket

REQ = PlacementRequest(num_prompt_tokens=256, block_size=16)


def decode(node_id: str, step_s: float = 0.0, running: int = 1, updated_at: float = 0.0, port: int = 1) -> NodeInfo:
    return NodeInfo(node_id=node_id, role="decode", grpc_address=f"{node_id}:{port}", fingerprint="fp",
                    block_size=16, num_blocks=100, running=running, step_s=step_s, updated_at=updated_at)


def heartbeats(history: StepHistory, node: NodeInfo, steps: list[float], t0: float = 0.0) -> float:
    """One heartbeat a second with these step times; returns the time of the last."""
    t = t0
    for i, s in enumerate(steps):
        t = t0 + i
        history.observe([replace(node, step_s=s, updated_at=t)], t)
    return t


def test_batch_buckets_differ_by_less_than_2x():
    assert [batch_bucket(r) for r in (0, 1, 2, 3, 4, 7, 8, 64)] == [1, 1, 2, 2, 3, 3, 4, 7]


def test_best_needs_enough_samples_and_ignores_a_few_outliers():
    h = StepHistory()
    d = decode("decode-0")
    t = heartbeats(h, d, [0.02] * (MIN_SAMPLES - 1))
    assert h.best(d, t) == 0.0  # too few to judge by
    t = heartbeats(h, d, [0.02], t + 1)
    assert h.best(d, t) == 0.02
    # a few unusually fast heartbeats do not set the node's best
    t = heartbeats(h, d, [0.001] * (MIN_SAMPLES - 1), t + 1)
    assert h.best(d, t) == 0.02


def test_a_heartbeat_read_twice_is_one_sample():
    h = StepHistory()
    d = decode("decode-0", step_s=0.02, updated_at=5.0)
    for i in range(3 * MIN_SAMPLES):  # the view refreshes faster than the node heartbeats
        h.observe([d], 5.0 + i * 0.1)
    assert h.best(d, 7.0) == 0.0


def test_compared_at_a_comparable_batch_only():
    h = StepHistory()
    t = heartbeats(h, decode("decode-0", running=1), [0.01] * 10)
    busy = decode("decode-0", step_s=0.05, running=32, updated_at=t + 1)
    # 5x its best at batch 1 but no history at batch 32: not a straggler by its own measure
    assert h.best(busy, t + 1) == 0.0
    annotated = h.annotate([busy], t + 1)
    assert without_stragglers(list(annotated)) == list(annotated)


def test_history_expires_and_a_restarted_life_starts_fresh():
    h = StepHistory()
    d = decode("decode-0")
    t = heartbeats(h, d, [0.02] * 10)
    assert h.best(d, t) == 0.02
    assert h.best(replace(d, grpc_address="decode-0:2"), t) == 0.0  # Ray's restart: same id, new port
    h.observe([], t + WINDOW_S + 1)
    assert h.best(d, t + WINDOW_S + 1) == 0.0
    assert not h._samples and not h._last_update  # nothing kept for nodes long gone


def test_a_slowed_node_is_a_straggler_without_any_peer_measurement():
    """The gap of issue 12's slow-node scenario: decode-1 just restarted (no step time), so the
    peer comparison has nothing to go on; decode-0's own earlier speed exposes it."""
    h = StepHistory()
    d0 = decode("decode-0")
    t = heartbeats(h, d0, [0.02] * 20)
    restarted = decode("decode-1", port=2)
    slowed = replace(d0, step_s=0.2, updated_at=t + 1)
    nodes = h.annotate([NodeInfo("prefill-0", "prefill", "p:1", "fp", 16, 100), slowed, restarted], t + 1)
    assert nodes[1].step_best_s == 0.02 and nodes[2].step_best_s == 0.0
    for policy in (PrefixLoadPolicy(short_prompt_tokens=64), TtftPolicy(CostBook(), short_prompt_tokens=64)):
        # decode-0 has the lower id and equal load: only the straggler check moves the request
        assert policy.choose(REQ, list(nodes), {}).decode_node.node_id == "decode-1"
    assert without_stragglers([nodes[1]]) == [nodes[1]]  # the lone decode node is still used
    assert without_stragglers(list(nodes[1:]), factor=0) == list(nodes[1:])  # 0: off
    assert without_stragglers(list(nodes[1:]), factor=20.0) == list(nodes[1:])  # within the factor
    # within 3x of its own best: not a straggler
    ok = replace(nodes[1], step_s=0.059)
    assert without_stragglers([ok, nodes[2]]) == [ok, nodes[2]]


def test_the_factor_is_the_policys():
    slow = replace(decode("decode-0", step_s=0.05), step_best_s=0.02)  # 2.5x its own best
    other = decode("decode-1", port=2)
    assert PrefixLoadPolicy(slow_step_factor=2.0).choose(REQ, [slow, other], {}).decode_node.node_id == "decode-1"
    assert PrefixLoadPolicy(slow_step_factor=3.0).choose(REQ, [slow, other], {}).decode_node.node_id == "decode-0"


def test_router_config_straggler_factor():
    base = dict(redis_url="redis://x", model_name="m", tokenizer_dir="t", max_model_len=64)
    assert RouterConfig(**base).straggler_factor == 3.0
    assert RouterConfig(**base, straggler_factor=0).straggler_factor == 0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="straggler_factor"):
            RouterConfig(**base, straggler_factor=bad)


class Registry:
    """Stands in for IndexReader's node read: what the registry holds now."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeInfo] = {}

    def live_nodes(self) -> dict[str, NodeInfo]:
        return dict(self.nodes)


def test_the_node_view_fills_in_each_nodes_own_best():
    reg = Registry()
    refresher = NodeRefresher(reg, refresh_s=0.5, prune_every_s=10.0)
    for i in range(10):
        reg.nodes = {"decode-0": decode("decode-0", step_s=0.02, updated_at=float(i))}
        refresher.refresh_once()
    reg.nodes = {"decode-0": decode("decode-0", step_s=0.3, updated_at=10.0)}
    (d,) = refresher.refresh_once().nodes
    assert d.step_s == 0.3 and d.step_best_s == 0.02
