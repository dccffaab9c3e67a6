"""When the router calls a node failed for a request, the parts without sockets
(router/liveness.py, router/migration.py): the progress deadline from the node's step time,
the Prefill deadline from the cost model, how a call's status is read, the step-error retry
budget, node-wide failures shared between streams, and the flags that set them."""
from __future__ import annotations

import argparse
import math

import grpc
import pytest

from kv_index.nodes import NodeInfo, Role
from router import liveness
from router.admission import Estimate
from router.migration import STEP_ERROR_BUDGET, Exclusions, is_step_error, refusal

FACTOR, FLOOR, CEILING = 10.0, 3.0, 30.0


@pytest.mark.parametrize("step_s, bound", [
    (0.1, 3.0),  # 10 x 100 ms = 1 s: the floor (one long step must not count as a failure)
    (0.45, 4.5),  # in between: the node's own pace
    (2.0, 20.0),
    (5.0, 30.0),  # a very slow node is still given up on at the ceiling
    (0.0, 30.0),  # unknown (idle until now): the ceiling, its first step warms it up
    (-1.0, 30.0),
])
def test_progress_bound_scales_with_the_nodes_step_time(step_s, bound):
    assert liveness.progress_bound_s(step_s, FACTOR, FLOOR, CEILING) == pytest.approx(bound)


def test_the_default_bound_detects_a_frozen_decode_node_on_the_builtin_model_within_5_s():
    from router.config import RouterConfig

    cfg = RouterConfig(redis_url="redis://x", model_name="m", tokenizer_dir="/t", max_model_len=64)
    # SmolLM2-135M on CPU decodes a batch of 8 in 0.1-0.4 s per step (docs/environment.md).
    for step_s in (0.05, 0.1, 0.2, 0.4):
        bound = liveness.progress_bound_s(step_s, cfg.decode_progress_factor, cfg.decode_progress_floor_s,
                                          cfg.decode_progress_ceiling_s)
        assert bound <= 5.0 - cfg.node_refresh_s
    # and heartbeats come at least four times per shortest bound
    assert liveness.heartbeat_period_s(cfg.decode_progress_floor_s) * 4 <= cfg.decode_progress_floor_s
    assert liveness.heartbeat_period_s(100.0) == liveness.MAX_HEARTBEAT_S


@pytest.mark.parametrize("estimate, deadline", [
    (None, 120.0),  # no prediction (policy prefix_load): the ceiling, prefill_timeout_s
    (Estimate(queue_s=0.0, prefill_s=0.5, transfer_s=0.1), 10.0),  # 4 x 0.6 s: the floor
    (Estimate(queue_s=2.0, prefill_s=4.0, transfer_s=1.0), 28.0),  # queue counts: it waits there too
    (Estimate(queue_s=20.0, prefill_s=20.0, transfer_s=5.0), 120.0),
])
def test_prefill_deadline_follows_the_cost_models_prediction(estimate, deadline):
    assert liveness.prefill_deadline_s(estimate, 4.0, 10.0, 120.0) == pytest.approx(deadline)


@pytest.mark.parametrize("code, details, reason", [
    (grpc.StatusCode.UNAVAILABLE, "Stream removed (ping timeout)", liveness.KEEPALIVE),
    (grpc.StatusCode.UNAVAILABLE, "keepalive watchdog timeout", liveness.KEEPALIVE),
    (grpc.StatusCode.UNAVAILABLE, "Socket closed", liveness.UNAVAILABLE),
    (grpc.StatusCode.CANCELLED, None, liveness.UNAVAILABLE),
    (grpc.StatusCode.INTERNAL, "engine step failed: RuntimeError()", liveness.STEP_ERROR),
    (grpc.StatusCode.INVALID_ARGUMENT, "bad", None),  # about the request: back to the client
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "full", None),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", None),
])
def test_a_calls_status_says_how_the_node_failed(code, details, reason):
    assert liveness.call_failure(code, details) == reason


def test_internal_is_a_step_error_as_status_or_in_stream_code():
    assert is_step_error(grpc.StatusCode.INTERNAL) and is_step_error(13)
    assert not is_step_error(grpc.StatusCode.UNAVAILABLE) and not is_step_error(14)


def move(**kw) -> str | None:
    args = dict(step_error=False, n=1, yielded=True, migrations=0, max_migrations=2, step_errors=0, aborted=False)
    args.update(kw)
    return refusal(**args)


def test_a_step_error_moves_the_request_once():
    assert STEP_ERROR_BUDGET == 1
    assert move(step_error=True, step_errors=1) is None  # the first: the node's, retried elsewhere
    why = move(step_error=True, step_errors=2, migrations=1)  # the second: likely the request's own
    assert why is not None and "2 times" in why
    # a step error after a dead node still has its own move
    assert move(step_error=True, step_errors=1, migrations=1) is None
    # within max_migrations all the same
    assert "max_migrations" in move(step_error=True, step_errors=1, migrations=2)


def test_other_failures_move_until_max_migrations():
    assert move() is None and move(migrations=1) is None
    assert "max_migrations (2)" in move(migrations=2)
    assert move(max_migrations=0) is not None
    assert move(aborted=True) == "aborted"
    assert "forked" in move(n=2)  # samples forked on the failed node: a continuation cannot redo them
    assert move(n=2, yielded=False) is None  # nothing out yet: a plain retry


def node(nid: str, address: str = "127.0.0.1:1") -> NodeInfo:
    return NodeInfo(node_id=nid, role=Role.DECODE, grpc_address=address, fingerprint="f", block_size=16,
                    num_blocks=64)


def test_a_node_wide_failure_moves_the_nodes_other_streams():
    ex = Exclusions(exclude_s=10.0)
    a, b = node("decode-0"), node("decode-1", "127.0.0.1:2")
    key_a = (a.node_id, a.grpc_address)
    ex.exclude(a, now=100.0, node_wide=liveness.PROGRESS_DEADLINE)
    assert ex.failed_since(key_a, since=90.0) == liveness.PROGRESS_DEADLINE  # a stream opened before it
    assert ex.failed_since(key_a, since=101.0) is None  # a stream opened after it watches for itself
    ex.exclude(b, now=100.0)  # a step error: excluded from placement, the node's other streams stay
    assert ex.failed_since((b.node_id, b.grpc_address), since=90.0) is None
    assert ex.active(105.0) == {key_a, (b.node_id, b.grpc_address)}
    assert ex.active(111.0) == frozenset() and ex.failed_since(key_a, since=90.0) is None  # forgotten


@pytest.mark.parametrize("bad", [
    dict(decode_progress_floor_s=0.0), dict(decode_progress_floor_s=40.0), dict(decode_progress_factor=0.0),
    dict(decode_progress_ceiling_s=math.inf), dict(decode_progress_floor_s=math.nan),
    dict(prefill_deadline_floor_s=200.0), dict(prefill_deadline_factor=-1.0),
])
def test_unusable_deadlines_are_refused(bad):
    from router.config import RouterConfig

    with pytest.raises(ValueError, match="need"):
        RouterConfig(redis_url="redis://x", model_name="m", tokenizer_dir="/t", max_model_len=64, **bad)


FLAGS = ("--decode-progress-factor", "5", "--decode-progress-floor", "2", "--decode-progress-ceiling", "20",
         "--prefill-deadline-factor", "3", "--prefill-deadline-floor", "7")
FIELDS = ("decode_progress_factor", "decode_progress_floor_s", "decode_progress_ceiling_s",
          "prefill_deadline_factor", "prefill_deadline_floor_s")


def test_flags_reach_the_router_config_from_pdserve_up_and_router_server():
    from deploy.cli import add_up_arguments, cluster_config_from_args
    from deploy.launcher import router_config
    from frontend.server import build_parser
    from router.config import RouterConfig

    p = argparse.ArgumentParser()
    add_up_arguments(p)
    bring_up = dict(redis_url="redis://x", model_name="m", tokenizer_dir="/t", max_model_len=64)
    rc = router_config(cluster_config_from_args(p.parse_args(list(FLAGS))), **bring_up)
    assert tuple(getattr(rc, f) for f in FIELDS) == (5.0, 2.0, 20.0, 3.0, 7.0)
    required = ["--redis-url", "redis://x", "--tokenizer-dir", "/t", "--model-name", "m", "--max-model-len", "64"]
    args = build_parser().parse_args(required + list(FLAGS))
    assert tuple(getattr(args, f) for f in FIELDS) == (5.0, 2.0, 20.0, 3.0, 7.0)
    # the defaults agree: RouterConfig, `pdserve up`, frontend.server
    defaults = RouterConfig(**bring_up)
    up = router_config(cluster_config_from_args(p.parse_args([])), **bring_up)
    cli = build_parser().parse_args(required)
    for f in FIELDS:
        assert getattr(defaults, f) == getattr(up, f) == getattr(cli, f), f
    with pytest.raises(ValueError, match="decode_progress"):
        cluster_config_from_args(p.parse_args(["--decode-progress-floor", "nan"]))


def test_the_sdk_ignores_a_heartbeat():
    from pdserve.core import ResponseAccumulator
    from protos.pdserve.v1 import serving_pb2 as pb

    acc = ResponseAccumulator()
    assert acc.feed(pb.GenerateResponse(request_id="r", heartbeat=pb.Heartbeat(engine_progress=3))) is None
    chunk = acc.feed(pb.GenerateResponse(request_id="r", chunk=pb.Chunk(index=0, token_ids=[5], text="a")))
    assert chunk.token_ids == (5,) and acc.completions == {}
