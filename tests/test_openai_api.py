"""The OpenAI-compatible HTTP API against a live local cluster (Redis, Ray actors, gRPC,
SmolLM2-135M), driven by the official ``openai`` package as users drive it.

One cluster (1 prefill node, 1 decode node, the router with its HTTP server) serves every test
in this module.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import openai
import pytest
import ray

import pdserve

pytestmark = [pytest.mark.e2e, pytest.mark.local_cluster(prefill_nodes=1, decode_nodes=1, short_prompt_tokens=16)]

MODEL = "smollm2-135m"
SYSTEM = ("You are a helpful assistant for a company that builds distributed systems. Answer briefly "
          "and precisely; when unsure, say so.")


def chat(q: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


@pytest.fixture(scope="module")
def base_url(local_cluster) -> str:
    return f"http://{local_cluster.http_address}"


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_health_and_ready(base_url):
    assert get(f"{base_url}/health") == (200, '{"status":"ok"}')
    status, body = get(f"{base_url}/ready")
    assert status == 200 and json.loads(body)["ready"] is True, body


def test_chat_equals_the_grpc_sdk_and_reports_usage(client, local_cluster):
    msgs = chat("What is the capital of France?")
    with pdserve.Client(local_cluster.address, timeout=120) as sdk:
        expected = sdk.complete(msgs, max_tokens=24, temperature=0.0)
    resp = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0.0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert "Paris" in choice.message.content
    assert choice.finish_reason == {"stop": "stop", "length": "length"}[expected.finish_reason]
    u = resp.usage
    assert u.prompt_tokens == expected.usage.prompt_tokens and u.completion_tokens == len(expected.token_ids)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # Asked twice with the same long prefix: the second request's prompt came from the cache.
    assert u.prompt_tokens_details.cached_tokens > 0
    assert resp.id.startswith("chatcmpl-") and resp.model == MODEL


def test_streaming_chat_with_usage_equals_the_whole_answer(client):
    msgs = chat("Name three colors.")
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0.0)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_sse_ends_with_done(base_url):
    body = {"model": MODEL, "messages": chat("Say hi."), "max_tokens": 4, "temperature": 0, "stream": True}
    req = urllib.request.Request(f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln.decode().rstrip("\n") for ln in r if ln.strip()]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"


def test_async_completions_stream_and_batch(base_url):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as c:
            whole = await c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                               temperature=0.0)
            stream = await c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                                temperature=0.0, stream=True)
            text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
            batch = await c.completions.create(model=MODEL, prompt=["One, two,", "Monday, Tuesday,"],
                                               max_tokens=6, temperature=0.0)
            return whole, text, batch

    whole, text, batch = asyncio.run(run())
    assert whole.choices[0].text == text and whole.usage.completion_tokens == 8
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.usage.completion_tokens == 12


def test_sampling_fields_n_seed_and_logprobs(client):
    msgs = chat("Write one word.")
    kw = dict(model=MODEL, messages=msgs, max_completion_tokens=6, temperature=0.9, top_p=0.95, seed=7, n=2,
              presence_penalty=0.5, frequency_penalty=0.5, logprobs=True, top_logprobs=3)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # seeded
    assert len(a.choices) == 2 and a.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in a.choices)
    for c in a.choices:
        assert c.logprobs.content, "one logprob entry per token"
        for entry in c.logprobs.content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    stop = client.chat.completions.create(model=MODEL, messages=chat("Count from 1 to 10, separated by commas."),
                                          max_tokens=40, temperature=0.0, stop=["5"])
    assert "5" not in stop.choices[0].message.content and stop.choices[0].finish_reason == "stop"


def test_extra_body_takes_pdserve_hints(client):
    r = client.chat.completions.create(model=MODEL, messages=chat("Say yes."), max_tokens=3, temperature=0.0,
                                       extra_body={"slo_class": "batch", "session_id": "s-1", "top_k": 5})
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=chat("x"), extra_body={"slo_class": "fastest"})
    assert e.value.status_code == 400 and "slo_class" in str(e.value)


def test_errors_are_openai_shaped_and_name_the_limit(client, base_url):
    max_len = json.loads(get(f"{base_url}/v1/models")[1])["data"][0]["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * (max_len + 10), max_tokens=4)
    msg = e.value.body["message"]
    assert f"maximum context length is {max_len} tokens" in msg and f"the prompt has {max_len + 10} tokens" in msg
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="exceeds this model's maximum context length"):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=max_len)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=chat("hi"))
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=MODEL, messages=chat("hi"), tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            tool_choice={"type": "function", "function": {"name": "g"}})
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=chat("hi"), temperature=5)


def _decode_free_blocks(local_cluster) -> int:
    return ray.get(local_cluster.actors["decode-0"].stats.remote())["free_blocks"]


def _wait_free(local_cluster, want: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    free = _decode_free_blocks(local_cluster)
    while free != want and time.monotonic() < deadline:
        time.sleep(0.2)
        free = _decode_free_blocks(local_cluster)
    return free


def test_a_closed_stream_frees_its_kv_on_the_nodes(client, local_cluster):
    before = _wait_free(local_cluster, _decode_free_blocks(local_cluster))
    stream = client.chat.completions.create(model=MODEL, messages=chat("Tell me a very long story about a ship."),
                                            max_tokens=1500, temperature=0.0, extra_body={"ignore_eos": True},
                                            stream=True)
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 3:
            break
    assert _decode_free_blocks(local_cluster) < before  # the request holds blocks while it runs
    stream.close()
    assert _wait_free(local_cluster, before) == before


def test_router_metrics_after_requests(base_url, client, local_cluster):
    client.chat.completions.create(model=MODEL, messages=chat("Say ok."), max_tokens=2, temperature=0.0)
    status, text = get(f"{base_url}/metrics")
    assert status == 200
    for name in ("pdserve:time_to_first_token_seconds_count", "pdserve:e2e_request_latency_seconds_count",
                 "pdserve:inter_token_latency_seconds_count", "pdserve:request_queue_time_seconds_count",
                 "pdserve:prompt_tokens_total", "pdserve:generation_tokens_total", "pdserve:request_success_total",
                 "pdserve:router_decisions_total", "pdserve:requests_rejected_total", "pdserve:num_requests_running",
                 "pdserve:index_freshness_seconds", "pdserve:index_accuracy"):
        assert f"\n{name}" in text, name
    assert 'model_name="smollm2-135m"' in text
    # Node series carry the same model name (not the model's local path), so they join the router's.
    node_metrics = ray.get(local_cluster.actors["decode-0"].stats.remote())["metrics_address"]
    status, node_text = get(f"http://{node_metrics}/metrics")
    assert status == 200 and 'pdserve:num_requests_running{model_name="smollm2-135m",node_id="decode-0",role="decode"}' in node_text


@pytest.mark.parametrize("api", ["grpc", "openai"])
def test_bench_serve_against_the_cluster(local_cluster, api, tmp_path, capsys):
    from deploy.cli import main

    url = local_cluster.address if api == "grpc" else f"http://{local_cluster.http_address}"
    records = tmp_path / "records.jsonl"
    rc = main(["bench", "serve", "--url", url, "--api", api, "--workload", "chat", "--num-requests", "4",
               "--max-tokens-cap", "12",
               "--rates", "8,16", "--slo-ttft", "60", "--slo-tpot", "10", "--records", str(records),
               "--plot", str(tmp_path / "serve"), "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [p["rate"] for p in result["points"]] == [8.0, 16.0]
    for p in result["points"]:
        assert p["completed"] == 4 and p["failed"] == 0
        assert p["ttft_s"]["p50"] > 0 and p["tpot_s"]["p50"] > 0 and p["goodput_rps"] > 0
        assert p["output_throughput"] > 0
    lines = [json.loads(x) for x in records.read_text().splitlines()]
    assert len(lines) == 8 and all(x["output_tokens"] == x["max_tokens"] for x in lines)  # ignore_eos
    assert (tmp_path / "serve_cdf.png").stat().st_size > 0 and (tmp_path / "serve_goodput.png").stat().st_size > 0
