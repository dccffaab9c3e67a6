"""vLLM nodes (``--engine vllm``, issue 46 section 1).

The pure parts (framing, the parameter mapping, what is refused and where) run everywhere and
take well under a second. The live tests need vLLM's own Python: $PDSERVE_VLLM_PYTHON, the
repo's .venv-vllm (`make vllm`); without one they skip, saying so (CI has neither). They bring
up `pdserve up --engine vllm --prefill-nodes 0 --decode-nodes 2` (real Redis, Ray, gRPC, vLLM
children) and one plain vLLM instance, compare greedy float32 and seeded outputs token by token,
SIGKILL an idle node's vLLM child, then a streaming one's mid-stream (about 4 minutes in all on
2 loaded cores, most of it vLLM starting five times).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from node.vllm_wire import (
    MAX_FRAME,
    FrameError,
    FrameReader,
    UnsupportedByVllm,
    encode,
    parse_command,
    send,
    to_worker_sampling,
    vllm_sampling_kwargs,
)
from protos.pdserve.v1 import vllm_worker_pb2 as wpb
from tokens.sampling_params import SamplingParams, StructuredOutput

REPO = Path(__file__).resolve().parent.parent


def find_vllm_python() -> str | None:
    # Not a machine path of its own: a vLLM environment left on a dev machine must not turn a
    # CI-like run into a 2-minute longer one without being asked for.
    for cand in (os.environ.get("PDSERVE_VLLM_PYTHON"), str(REPO / ".venv-vllm/bin/python")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


VLLM_PYTHON = find_vllm_python()
needs_vllm = pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM Python: set PDSERVE_VLLM_PYTHON or run "
                                "`make vllm` (.venv-vllm); the live vLLM node tests did not run")


# ---------------------------------------------------------------- framing
def test_frames_round_trip_whole_split_and_several_at_once() -> None:
    cmds = [wpb.WorkerCommand(add=wpb.WorkerAdd(request_id="a", prompt_token_ids=[1, 2, 3])),
            wpb.WorkerCommand(abort=wpb.WorkerAbort(request_id="a")),
            wpb.WorkerCommand(shutdown=wpb.WorkerShutdown())]
    data = b"".join(encode(c) for c in cmds)
    whole = FrameReader().feed(data)
    assert [parse_command(f) for f in whole] == cmds
    r, got = FrameReader(), []
    for i in range(len(data)):  # a byte at a time: frames complete only when their last byte came
        got += r.feed(data[i:i + 1])
    assert [parse_command(f) for f in got] == cmds


def test_an_oversized_frame_is_refused_before_it_is_read() -> None:
    with pytest.raises(FrameError, match="limit"):
        FrameReader().feed((MAX_FRAME + 1).to_bytes(4, "big"))


def test_a_closed_peer_is_a_frame_error() -> None:
    a, b = socket.socketpair()
    with a, b:
        send(b, wpb.WorkerCommand(shutdown=wpb.WorkerShutdown()))
        b.close()
        r = FrameReader()
        assert [parse_command(f).WhichOneof("kind") for f in r.read_available(a)] == ["shutdown"]
        with pytest.raises(FrameError, match="closed"):
            r.read_available(a)


# ---------------------------------------------------------------- parameters
def test_parameters_map_onto_vllms() -> None:
    p = SamplingParams(max_tokens=7, min_tokens=2, temperature=0.0, top_k=5, top_p=0.9, seed=0,
                       stop_token_ids=(2, 9), stop=("\n\n",), ignore_eos=True, repetition_penalty=1.1)
    kw = vllm_sampling_kwargs(to_worker_sampling(p))
    assert kw["max_tokens"] == 7 and kw["min_tokens"] == 2 and kw["temperature"] == 0.0
    assert kw["top_k"] == 5 and kw["top_p"] == pytest.approx(0.9) and kw["repetition_penalty"] == pytest.approx(1.1)
    assert kw["seed"] == 0  # seed 0 is a seed, not "none"
    assert kw["stop_token_ids"] == [2, 9] and kw["stop"] == ["\n\n"] and kw["ignore_eos"] is True
    assert vllm_sampling_kwargs(to_worker_sampling(SamplingParams(top_k=-1)))["seed"] is None
    assert vllm_sampling_kwargs(to_worker_sampling(SamplingParams(top_k=-1)))["top_k"] == 0  # off in both


@pytest.mark.parametrize("params, field", [
    (SamplingParams(n=2), "n"),
    (SamplingParams(logprobs=1), "logprobs"),
    (SamplingParams(structured=StructuredOutput("json_object")), "structured"),
])
def test_what_the_bridge_cannot_carry_is_refused_by_name(params: SamplingParams, field: str) -> None:
    with pytest.raises(UnsupportedByVllm, match=field) as err:
        to_worker_sampling(params)
    assert err.value.field == field


def test_a_continuation_counts_its_resumed_tokens_against_the_budgets() -> None:
    from engine.errors import InvalidRequestError
    from node.vllm_engine import resumed_params

    p = resumed_params(SamplingParams(max_tokens=10, min_tokens=4, temperature=0.0), 6)
    assert (p.max_tokens, p.min_tokens) == (4, 0)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        resumed_params(SamplingParams(max_tokens=6), 6)


def test_vllm_pools_are_decode_only_and_refused_at_start() -> None:
    from deploy.cluster_config import ClusterConfig
    from deploy.node_servers import build_vllm_node, server_builder
    from engine.config import EngineConfig
    from kv_index.nodes import Role

    with pytest.raises(ValueError, match="--prefill-nodes 0"):
        ClusterConfig(engine=EngineConfig(backend="vllm"), prefill_nodes=1)
    with pytest.raises(ValueError, match="decode nodes only"):
        server_builder(Role.PREFILL, "vllm")
    assert server_builder(Role.DECODE, "vllm") is build_vllm_node
    assert build_vllm_node.roles == (Role.DECODE,)  # a live switch to prefill is refused, not tried
    with pytest.raises(ValueError, match="backend"):
        EngineConfig(backend="sglang")


def test_a_checkpoint_without_embed_tokens_is_refused(tmp_path: Path) -> None:
    # vLLM loads tied embeddings from model.embed_tokens.weight only: without it, it serves zeros.
    import numpy as np
    from safetensors.numpy import save_file

    from engine.errors import InvalidRequestError
    from node.vllm_engine import check_checkpoint

    save_file({"lm_head.weight": np.zeros((4, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(InvalidRequestError, match="model.embed_tokens.weight"):
        check_checkpoint(tmp_path)
    save_file({"model.embed_tokens.weight": np.zeros((4, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    check_checkpoint(tmp_path)


def test_no_vllm_python_names_every_place_looked(monkeypatch) -> None:
    from node import vllm_engine

    monkeypatch.setattr(vllm_engine, "REPO", Path("/nonexistent"))
    with pytest.raises(FileNotFoundError, match="make vllm") as err:
        vllm_engine.vllm_python(None, env={})
    assert "PDSERVE_VLLM_PYTHON" in str(err.value) and "--vllm-python" in str(err.value)


# ---------------------------------------------------------------- live: a vLLM node in a cluster
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three colors are"]


def _cases(model_dir: str) -> list[dict]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    ids = [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    greedy = [{"prompt": i, "params": {"max_tokens": 24, "temperature": 0.0}} for i in ids]
    seeded = {"prompt": ids[0], "params": {"max_tokens": 16, "temperature": 0.8, "top_p": 0.95, "seed": 7}}
    stop = {"prompt": ids[1], "params": {"max_tokens": 24, "temperature": 0.0, "stop_token_ids": [198]}}
    long = {"prompt": ids[2], "params": {"max_tokens": 64, "temperature": 0.0, "ignore_eos": True}}
    return [*greedy, seeded, stop, long]


@pytest.fixture(scope="module")
def vllm_cluster():
    from deploy.launcher import ClusterConfig, LocalCluster
    from tests.clusters import SMOLLM2

    engine = replace(SMOLLM2, backend="vllm", vllm_python=VLLM_PYTHON)
    config = ClusterConfig(engine=engine, prefill_nodes=0, decode_nodes=2, grpc_port=0, http_port=0, dashboard_port=0)
    with LocalCluster(config) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(vllm_cluster):
    """The cases and what one plain vLLM instance answers them (vLLM's Python, same env knobs)."""
    model_dir = str(vllm_cluster.model_dir)
    cases = _cases(model_dir)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    out = subprocess.run([VLLM_PYTHON, str(REPO / "tests/vllm_reference.py"), model_dir], input=json.dumps(cases),
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return cases, json.loads(out.stdout.strip().splitlines()[-1])


def _generate(address: str, case: dict):
    import pdserve

    with pdserve.Client(address, timeout=180) as client:
        return client.complete(token_ids=case["prompt"], **case["params"])


@needs_vllm
def test_outputs_equal_one_plain_vllm_instance(vllm_cluster, reference) -> None:
    cases, want = reference
    got = [_generate(vllm_cluster.address, case) for case in cases]
    for case, g, w in zip(cases, got, want):
        assert w and list(g.token_ids) == w, case["params"]
    assert "Paris" in got[0].text  # a real answer: embeddings loaded (not every token id 0)
    assert 198 not in want[4][:-1]  # the stop token ended that case (where it came)


@needs_vllm
def test_what_vllm_cannot_honour_is_refused_by_name(vllm_cluster) -> None:
    import pdserve

    with pdserve.Client(vllm_cluster.address, timeout=60) as client:
        for kwargs, name in (({"logprobs": 1}, "logprobs"), ({"response_format": {"type": "json_object"}}, "structured")):
            with pytest.raises(pdserve.InvalidRequestError, match=name):
                client.complete("Hello", max_tokens=4, **kwargs)


def _wait(cond, what: str, limit_s: float = 240.0):
    """Poll ``cond`` until it is truthy (returned); the bound only keeps a broken build from hanging."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


@needs_vllm
def test_a_killed_vllm_child_is_a_dead_node(vllm_cluster, reference) -> None:
    from kv_index.client import redis_client
    from kv_index.health import HealthStore

    actor = vllm_cluster.actors["decode-0"]
    before = _wait(lambda: _serving(vllm_cluster, "decode-0"), "decode-0 serving")
    assert before["engine_backend"] == "vllm"
    os.kill(before["vllm_pid"], signal.SIGKILL)
    refresher = vllm_cluster.router.orchestrator.refresher
    # The router stops placing on it: the node leaves its view (the lease is not waited for).
    _wait(lambda: not any(n.node_id == "decode-0" for n in refresher.view.nodes), "decode-0 left the router's view")
    # Meanwhile requests go to the other node.
    cases, want = reference
    other = _wait(lambda: _serving(vllm_cluster, "decode-1"), "decode-1 serving")
    assert list(_generate(vllm_cluster.address, cases[0]).token_ids) == want[0]
    assert _wait(lambda: _serving(vllm_cluster, "decode-1"), "decode-1 stats")["decodes"] == other["decodes"] + 1
    store = HealthStore(redis_client(vllm_cluster.redis_url), vllm_cluster.config.namespace)
    # Its health record names the cause (kept once the node serves again).
    dead = f"vLLM child (pid {before['vllm_pid']}) exited"
    _wait(lambda: dead in getattr(store.read("decode-0"), "reason", ""), "the reason in its health record")
    # Ray starts the node again: a fresh child, the same answers.
    after = _wait(lambda: _stats_if_new(actor, before["pid"]), "decode-0 serving again")
    assert after["healthy"] and after["vllm_pid"] != before["vllm_pid"]
    _wait(lambda: any(n.node_id == "decode-0" for n in refresher.view.nodes), "decode-0 back in the router's view")
    assert list(_generate(vllm_cluster.address, cases[0]).token_ids) == want[0]


def _serving(cluster, node_id: str):
    """The node's stats once it serves and the router sees it, else None."""
    import ray

    try:
        s = ray.get(cluster.actors[node_id].stats.remote(), timeout=10)
    except Exception:  # restarting: the actor is not answering yet
        return None
    seen = any(n.node_id == node_id for n in cluster.router.orchestrator.refresher.view.nodes)
    return s if s.get("healthy") and s.get("vllm_pid") and seen else None


@needs_vllm
def test_a_stream_whose_vllm_child_is_killed_continues_on_the_other_node(vllm_cluster, reference) -> None:
    import pdserve

    cases, want = reference
    case, full = cases[-1], want[-1]
    for nid in ("decode-0", "decode-1"):
        _wait(lambda: _serving(vllm_cluster, nid), f"{nid} serving")
    got, killed = [], None
    with pdserve.Client(vllm_cluster.address, timeout=180) as client:
        stream = client.generate(token_ids=case["prompt"], **case["params"])
        for chunk in stream:
            got.extend(chunk.token_ids)
            if killed is None and len(got) >= 4:
                busy = [s for s in (_serving(vllm_cluster, n) for n in ("decode-0", "decode-1")) if s and s["running"]]
                assert len(busy) == 1, busy
                os.kill(busy[0]["vllm_pid"], signal.SIGKILL)
                killed = busy[0]["node_id"]
    assert killed is not None and len(got) > 8  # killed mid-stream, well before its end
    assert got == full  # greedy: the continuation is the run that never failed, token for token


def _stats_if_new(actor, old_pid: int):
    import ray

    try:
        s = ray.get(actor.stats.remote(), timeout=10)
    except Exception:  # restarting: the actor is not answering yet
        return None
    return s if s["pid"] != old_pid and s.get("vllm_pid") else None
