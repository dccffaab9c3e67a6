"""The embedded cluster end to end: real Redis, real Ray actors, real gRPC, SmolLM2-135M.

One cluster (2 prefill nodes, 1 decode node, the router; tests/clusters.py) serves every test
in this module.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import openai
import pytest
import redis

import pdserve
from kv_index.nodes import Role
from kv_index.reader import IndexReader
from tokens.sampling_params import SamplingParams

# Every prompt here is a chat prompt of 30+ tokens: all take the disaggregated path.
pytestmark = [pytest.mark.e2e, pytest.mark.local_cluster(prefill_nodes=2, decode_nodes=1, short_prompt_tokens=16)]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = ("You are a helpful assistant for a company that builds distributed systems. Answer briefly "
          "and precisely; when unsure, say so. Prefer plain words over jargon.")
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "What is 12 times 12?",
    "Write a haiku about autumn.",
    "What does a CPU do?",
    "Give me one tip for better sleep.",
    "Translate 'thank you' into German.",
    "What is the largest planet in the solar system?",
]


def chat(q, system=None):
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]


def test_greedy_outputs_equal_the_single_process_engine(local_cluster, smollm2_reference):
    with pdserve.Client(local_cluster.address, timeout=120) as client:
        got = [client.complete(chat(q), max_tokens=24, temperature=0.0) for q in QUESTIONS]
    prompts = [smollm2_reference.encode(q, chat=True) for q in QUESTIONS]
    want = smollm2_reference.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for g, w in zip(got, want):
        assert list(g.token_ids) == w.outputs[0].token_ids
        assert g.text == w.outputs[0].text
        assert g.usage.prompt_tokens == len(w.prompt_token_ids)
        assert g.timings.prefill_s > 0  # went through a prefill node
    assert "Paris" in got[0].text


def test_shared_system_prompt_reuses_cached_blocks(local_cluster, smollm2_reference):
    # Long enough that reusing it clearly beats any difference in the two prefill nodes'
    # measured speeds (with a 40-token prefix the cost model may rightly pick the idle node
    # when the holder's last steps ran slow on a busy machine).
    # (Its own text from the start: the next test needs SYSTEM's blocks on one node only.)
    system = ("You answer questions about message brokers for an operations team. "
              + " ".join(f"Note {i}: keep answer {i} short." for i in range(18)))
    with pdserve.Client(local_cluster.address, timeout=120) as client:
        first = client.complete(chat("What is a load balancer?", system), max_tokens=16, temperature=0.0)
        second = client.complete(chat("What is a message queue?", system), max_tokens=16, temperature=0.0)
    assert second.usage.cached_prompt_tokens >= 128
    want = smollm2_reference.generate([smollm2_reference.encode("What is a message queue?", chat=True, system=system)],
                              SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert list(second.token_ids) == want.outputs[0].token_ids
    assert first.finish_reason in ("stop", "length")


def test_repeated_prefix_goes_to_the_prefill_node_that_holds_it(local_cluster):
    from router.tokenizer import PromptTokenizer
    from tokens.block_hash import hash_prompt_blocks

    reader = IndexReader(redis.Redis.from_url(local_cluster.redis_url), local_cluster.config.namespace)
    long_system = SYSTEM + " " + " ".join(f"Rule {i}: be kind to user {i}." for i in range(20))
    tok = PromptTokenizer(str(local_cluster.model_dir))
    with pdserve.Client(local_cluster.address, timeout=120) as client:
        client.complete(chat("Say hi.", long_system), max_tokens=4, temperature=0.0)
        prefill = [n for n in reader.live_nodes().values() if n.role == Role.PREFILL]
        ids = tok.encode_chat(chat("Say hello.", long_system))
        hashes = hash_prompt_blocks(ids, prefill[0].block_size, prefill[0].fingerprint.encode())
        matched = {n: m.blocks for n, m in reader.match(hashes, [n.node_id for n in prefill]).items()}
        holder = max(matched, key=matched.get)
        assert matched[holder] >= 4 and min(matched.values()) == 0  # exactly one node holds it
        out = client.complete(chat("Say hello.", long_system), max_tokens=4, temperature=0.0)
    # Only the holder can have served those tokens from its cache.
    assert out.usage.cached_prompt_tokens >= matched[holder] * prefill[0].block_size


def test_every_token_has_its_logprob_on_the_disaggregated_path(local_cluster, smollm2_reference):
    with pdserve.Client(local_cluster.address, timeout=120) as client:
        out = client.complete(chat(QUESTIONS[0]), max_tokens=8, temperature=0.0, logprobs=2)
    assert out.timings.prefill_s > 0  # the first token came from a prefill node
    assert len(out.logprobs) == len(out.token_ids) == 8
    assert [lp.token_id for lp in out.logprobs] == list(out.token_ids)
    want = smollm2_reference.generate([smollm2_reference.encode(QUESTIONS[0], chat=True)],
                              SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))[0].outputs[0]
    assert [lp.logprob for lp in out.logprobs] == pytest.approx(want.logprobs, abs=1e-4)


def test_index_entries_appear_after_prefill(local_cluster):
    r = redis.Redis.from_url(local_cluster.redis_url)
    assert r.keys(f"{{{local_cluster.config.namespace}}}:b:*")
    nodes = IndexReader(r, local_cluster.config.namespace).live_nodes()
    assert {n.role for n in nodes.values()} == {Role.PREFILL, Role.DECODE}
    assert len(nodes) == 3


def test_invalid_requests_are_rejected_with_the_limit(local_cluster):
    with pdserve.Client(local_cluster.address, timeout=60) as client:
        with pytest.raises(pdserve.InvalidRequestError, match="8192"):
            client.complete("hi", max_tokens=9000)
        with pytest.raises(pdserve.NotFoundError, match="smollm2-135m"):
            client.complete("hi", model="gpt-17", max_tokens=4)


def test_cli_generate_through_the_cluster(local_cluster):
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "generate", "--url", local_cluster.address,
                        "--max-tokens", "12", "What is the capital of France?"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "tok/s" in r.stderr


def test_pdserve_up_prints_ready_and_leaves_nothing_behind():
    import psutil

    from deploy.redis_server import free_port

    env = dict(os.environ)  # the root conftest set Ray and gRPC up for tests
    # ...but `pdserve up` runs as `make run` runs it: Ray's token authentication on (its own
    # default). It once started a GCS that wanted a token the driver did not send.
    env.pop("RAY_AUTH_MODE", None)
    port, http_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "up", "--grpc-port", str(port),
                             "--http-port", str(http_port), "--dashboard-port", "0", "--kv-cache-mib", "64"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    children = []
    try:
        deadline = time.monotonic() + 180
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("pdserve ready") or not line:
                break
        assert line.startswith(f"pdserve ready grpc=127.0.0.1:{port} http=127.0.0.1:{http_port} "
                               f"dashboard=http://127.0.0.1:"), line
        # Ray's token auth is on: the line names where the dashboard's token is, and Ray wrote it there.
        fields = dict(f.split("=", 1) for f in line.split()[2:])
        assert fields["dashboard_token"] == "$RAY_AUTH_TOKEN" or os.path.isfile(fields["dashboard_token"]), line
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("redis-server" in " ".join(c.cmdline()) for c in children)
        with pdserve.Client(f"127.0.0.1:{port}", timeout=60) as client:
            text = client.complete(chat("What is the capital of France?"), max_tokens=8, temperature=0.0).text
        assert "Paris" in text
        # What a new user does next: point the official OpenAI client at it and stream.
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0) as oc:
            stream = oc.chat.completions.create(model="smollm2-135m", messages=chat("What is the capital of France?"),
                                                max_tokens=8, temperature=0.0, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    finally:
        proc.terminate()
        proc.wait(60)
    assert proc.returncode == 0
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [c.cmdline()[:2] for c in alive]
