"""OpenAI request/response translation and the router's request metrics, on plain messages
(no server, no model)."""
from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from frontend import openai_protocol as oai
from frontend import openai_responses as oresp
from frontend.http_errors import ErrorResponse
from protos.pdserve.v1 import serving_pb2 as pb
from router.request_metrics import StreamObserver
from telemetry.metrics import RequestMetrics, RouterMetrics


def tok(i: int) -> str:
    return f"<{i}>"


def test_chat_request_maps_every_field():
    req = oai.ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                {"type": "text", "text": "there"}]}],
        "n": 2, "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0.5, "top_p": 0.9, "seed": 3,
        "presence_penalty": 0.1, "frequency_penalty": 0.2, "stop": "END", "logprobs": True, "top_logprobs": 4,
        "top_k": 10, "slo_class": "interactive", "session_id": "abc", "ignore_eos": True,
    })
    g = req.to_generate("rid")
    s = g.sampling
    assert g.request_id == "rid" and g.model == "m" and g.session_id == "abc"
    assert g.slo_class == pb.SLO_CLASS_INTERACTIVE
    assert [(m.role, m.content) for m in g.chat.messages] == [("system", "be brief"), ("user", "hi there")]
    assert (s.n, s.max_tokens, s.seed, s.top_k, list(s.stop), s.logprobs, s.ignore_eos) == (
        2, 7, 3, 10, ["END"], 4, True)  # max_completion_tokens wins over the deprecated max_tokens
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert s.presence_penalty == pytest.approx(0.1) and s.frequency_penalty == pytest.approx(0.2)


def test_unset_fields_stay_unset():
    g = oai.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}).to_generate("r")
    assert not g.sampling.HasField("max_tokens") and not g.sampling.HasField("temperature")
    assert not g.sampling.HasField("logprobs") and not g.sampling.HasField("seed")
    c = oai.CompletionRequest.model_validate({"prompt": "x"}).to_generate(["r"])[0]
    assert c.sampling.max_tokens == 16  # OpenAI's completions default
    assert c.text == "x"


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 5}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "structural_tag"}},
     "response_format.type"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
      "guided_regex": "a+"}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "any"}, "tool_choice"),
])
def test_unsupported_fields_are_refused_by_name(body, param):
    with pytest.raises(oai.UnsupportedError) as e:
        oai.ChatCompletionRequest.model_validate(body).to_generate("r")
    assert e.value.param == param


@pytest.mark.parametrize("body", [
    {"messages": []}, {"messages": [{"role": "user", "content": "x"}], "temperature": 3},
    {"messages": [{"role": "user", "content": "x"}], "n": 0},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21},
    {"messages": [{"role": "user", "content": "x"}], "slo_class": "fastest"},
])
def test_out_of_range_values_fail_validation(body):
    with pytest.raises(ValidationError):
        oai.ChatCompletionRequest.model_validate(body)


def test_completion_prompts_and_batches():
    reqs = oai.CompletionRequest.model_validate({"prompt": [[1, 2], [3]], "n": 2, "logprobs": 0}).to_generate(
        ["a", "b"])
    assert [list(r.tokens.ids) for r in reqs] == [[1, 2], [3]] and reqs[1].request_id == "b"
    assert reqs[0].sampling.logprobs == 0 and reqs[0].sampling.n == 2
    assert oai.CompletionRequest.model_validate({"prompt": [7, 8]}).prompts() == [[7, 8]]
    with pytest.raises(oai.UnsupportedError):
        oai.CompletionRequest.model_validate({"prompt": "x", "echo": True}).to_generate(["a"])
    with pytest.raises(oai.UnsupportedError):
        oai.CompletionRequest.model_validate({"prompt": "x", "best_of": 3}).to_generate(["a"])


def _chunk(index, ids, text, lps=None):
    c = pb.Chunk(index=index, token_ids=ids, text=text)
    for t, lp in zip(ids, lps or []):
        c.logprobs.append(pb.TokenLogprobs(token_id=t, logprob=lp, top=[pb.TopLogprob(token_id=t, logprob=lp)]))
    return pb.GenerateResponse(request_id="r", chunk=c)


def _complete(index, reason, prompt=5, completion=2, cached=3):
    return pb.GenerateResponse(request_id="r", complete=pb.Complete(
        index=index, finish_reason=reason,
        usage=pb.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_prompt_tokens=cached)))


def test_chat_stream_order_usage_and_logprobs():
    s = oresp.ChatStream("r", "m", want_logprobs=True, include_usage=True, token_text=tok)
    out = []
    for resp in (_chunk(0, [1], "Hel", [-0.5]), _chunk(1, [2], "Yo", [-0.1]), _chunk(0, [3], "lo", [-0.2]),
                 _complete(0, pb.FINISH_REASON_STOP), _complete(1, pb.FINISH_REASON_LENGTH, completion=1)):
        out += s.feed(resp)
    assert [o["choices"][0]["delta"] for o in out] == [
        {"role": "assistant", "content": "Hel"}, {"role": "assistant", "content": "Yo"}, {"content": "lo"}, {}, {}]
    assert [o["choices"][0]["finish_reason"] for o in out] == [None, None, None, "stop", "length"]
    assert out[0]["choices"][0]["logprobs"]["content"][0] == {
        "token": "<1>", "logprob": -0.5, "bytes": list(b"<1>"),
        "top_logprobs": [{"token": "<1>", "logprob": -0.5, "bytes": list(b"<1>")}]}
    assert all(o["usage"] is None for o in out)
    assert s.usage_chunk()["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                                        "prompt_tokens_details": {"cached_tokens": 3}}
    whole = oresp.chat_completion_json("r", "m", s.collected, False, tok)
    assert [c["message"]["content"] for c in whole["choices"]] == ["Hello", "Yo"]


def test_completion_logprobs_offsets_and_batched_indexes():
    e = oresp.CompletionStream("r", "m", prompt_index=1, n=2, want_logprobs=True, include_usage=False, token_text=tok)
    a = e.feed(_chunk(0, [1, 2], "ab", [-1.0, -2.0]))[0]["choices"][0]
    b = e.feed(_chunk(0, [3], "c", [-3.0]))[0]["choices"][0]
    assert a["index"] == 2  # prompt 1, sample 0, n=2
    assert a["logprobs"]["text_offset"] == [0, 3] and b["logprobs"]["text_offset"] == [2]
    assert a["logprobs"]["top_logprobs"] == [{"<1>": -1.0}, {"<2>": -2.0}]


def test_error_mapping_carries_retry_hints():
    r = ErrorResponse.from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", 1500).response()
    assert r.status_code == 429 and r.headers["retry-after"] == "2" and r.headers["retry-after-ms"] == "1500"
    r = ErrorResponse.from_grpc(grpc.StatusCode.UNAVAILABLE, "no node").response()
    assert r.status_code == 503 and "retry-after" in r.headers
    assert ErrorResponse.from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "bad").status == 400
    assert ErrorResponse.from_grpc(grpc.StatusCode.NOT_FOUND, "bad").status == 404


def _sample(registry, name, **labels):
    return registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


def test_stream_observer_measures_from_arrival():
    reg = CollectorRegistry()
    obs = StreamObserver(RequestMetrics(reg, {"model_name": "m"}), arrival=10.0)
    obs.queued(0.25)
    obs.feed(_chunk(0, [1], "a"), now=10.5)
    obs.feed(_chunk(0, [2, 3], "bc"), now=10.9)  # one speculative step, two tokens: 0.2 s each
    obs.feed(_complete(0, pb.FINISH_REASON_STOP, prompt=5, completion=3), now=11.0)
    obs.finish(now=11.0)
    obs.finish(now=99.0)  # once only
    assert _sample(reg, "pdserve:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert _sample(reg, "pdserve:inter_token_latency_seconds_count") == 2
    assert _sample(reg, "pdserve:inter_token_latency_seconds_sum") == pytest.approx(0.4)
    assert _sample(reg, "pdserve:e2e_request_latency_seconds_sum") == pytest.approx(1.0)
    assert _sample(reg, "pdserve:request_queue_time_seconds_sum") == pytest.approx(0.25)
    assert _sample(reg, "pdserve:prompt_tokens_total") == 5 and _sample(reg, "pdserve:generation_tokens_total") == 3
    assert _sample(reg, "pdserve:request_success_total", finished_reason="stop") == 1


def test_router_metrics_index_gauges_read_at_scrape_time():
    m = RouterMetrics("m")
    state = {"acc": None}
    m.watch_index(lambda: {"n1": 0.5}, lambda: state["acc"])
    assert m.registry.get_sample_value("pdserve:index_freshness_seconds", {"model_name": "m", "node_id": "n1"}) == 0.5
    assert m.registry.get_sample_value("pdserve:index_accuracy", {"model_name": "m"}) is None
    state["acc"] = 0.75
    assert m.registry.get_sample_value("pdserve:index_accuracy", {"model_name": "m"}) == 0.75
    m.decision("local")
    m.rejected("slo")
    assert m.registry.get_sample_value("pdserve:router_decisions_total", {"model_name": "m", "reason": "local"}) == 1
