"""Structured outputs and tool calls against live clusters, driven by the official ``openai``
client and the SDK: real Redis, real gRPC node servers on a tiny random model with SmolLM2's
vocabulary and tokenizer (in this process), the router's HTTP API.

Two clusters share the module: ``spec`` (a prefill node and two decode nodes that speculate
with n-gram drafts, chat prompts disaggregated) and ``plain`` (one decode node that prefills
itself and never speculates). Every answer of ``spec`` must equal ``plain``'s, byte for byte:
constrained decoding is exact across prefill -> decode, speculation and, in the last test, a
decode node killed in the middle of a JSON answer. A random model is what a constraint is
hardest on (it never wants to close a string), so "every output parses and validates" is
checked where it is least likely to hold by luck.
"""
from __future__ import annotations

import json
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import jsonschema
import openai
import pytest

import pdserve
from engine.config import SpeculativeConfig
from tests.clusters import start_node, start_router
from tests.helpers import engine_config, wait_for

pytestmark = pytest.mark.e2e
MAX_TOKENS = 96
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from engine.models.tiny import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "structured", seed=3, max_position_embeddings=2048)


class Cluster:
    """``speculate``: a prefill node and two decode nodes speculating with n-gram drafts; else
    one decode node that prefills itself and does not speculate. ``engine``: the nodes' engine
    (the tiny model by default)."""

    def __init__(self, redis_url: str, model, *, speculate: bool, engine=None) -> None:
        self.ns = f"structured-{uuid.uuid4().hex[:6]}"
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3,
                                 adaptive=False)
        roles = ([("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")] if speculate
                 else [("decode-0", "decode")])
        engine = engine or engine_config(model, num_blocks=512)
        self.nodes = {nid: start_node(role, nid, replace(engine, speculative=spec) if speculate and role == "decode"
                                      else engine, redis_url=redis_url, namespace=self.ns, lease_s=1.5,
                                      heartbeat_s=0.2, grpc_workers=8, load_tokenizer=True)
                      for nid, role in roles}
        self.router = start_router(redis_url, model, namespace=self.ns, http_port=0, max_model_len=2048,
                                   short_prompt_tokens=16 if speculate else 100_000,
                                   ready_min_prefill=1 if speculate else 0)
        self.http = openai.OpenAI(base_url=f"http://{self.router.http_address}/v1", api_key="unused",
                                  max_retries=0, timeout=TIMEOUT_S)
        with pdserve.Client(self.router.address) as c:
            assert wait_for(c.health, timeout=20, every=0.1)
        want = {nid for nid in self.nodes}
        assert wait_for(lambda: want <= {n.node_id for n in self.router.orchestrator.refresher.view.nodes}, 20)

    def chat(self, **kw):
        return self.http.chat.completions.create(model="m", temperature=0, max_tokens=MAX_TOKENS, **kw)

    def stop(self) -> None:
        self.http.close()
        self.router.stop()
        for s in self.nodes.values():
            if s.aengine is not None and s.aengine.alive:
                s.stop(grace_s=0)


@pytest.fixture(scope="module")
def clusters(redis_url, chat_model):
    spec = Cluster(redis_url, chat_model, speculate=True)
    plain = Cluster(redis_url, chat_model, speculate=False)
    yield spec, plain
    spec.stop()
    plain.stop()


@pytest.fixture(scope="module")
def smollm2(redis_url):
    """One decode node on the real SmolLM2-135M (greedy), for what a random model cannot show:
    a model that closes its JSON object by itself."""
    from engine.models.builtin import resolve_builtin
    from tests.clusters import SMOLLM2

    c = Cluster(redis_url, resolve_builtin("smollm2-135m"), speculate=False,
                engine=replace(SMOLLM2, num_threads=1, cache=replace(SMOLLM2.cache, num_blocks=128)))
    yield c
    c.stop()


def ask(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def both(clusters, **kw):
    """The same request to both clusters at once: (spec's response, plain's)."""
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda c: c.chat(**kw), clusters)
    return a, b


SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                 "required": ["name", "age"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "array_bounds": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "ranges": {"type": "object", "properties": {"score": {"type": "integer", "minimum": -5, "maximum": 5},
                                                "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
               "required": ["score", "ratio"], "additionalProperties": False},
    "nullable_optional": {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 8},
                                                           "extra": {"type": "boolean"}},
                          "required": ["note"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                                 "flag": {"type": "boolean"}},
                "required": ["code", "flag"], "additionalProperties": False},
    # Repeats itself: n-gram drafts find matches (and the grammar refuses some of them).
    "repeating": {"type": "object", "properties": {
        "steps": {"type": "array", "items": {"type": "object", "properties": {"op": {"enum": ["push", "pop"]}},
                                             "required": ["op"], "additionalProperties": False},
                  "minItems": 6, "maxItems": 6}},
        "required": ["steps"], "additionalProperties": False},
}


def json_schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_schema_answer_validates_and_equals_the_plain_cluster(clusters, name):
    a, b = both(clusters, messages=ask(f"Describe a {name} record as JSON."), response_format=json_schema_format(name))
    text = a.choices[0].message.content
    assert a.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert text == b.choices[0].message.content  # speculation, disaggregation: no change


def test_json_object_always_parses(smollm2):
    questions = ["Describe a cat as a JSON object.", "Give the capital of France as JSON.",
                 "List two colors in a JSON object."]
    with ThreadPoolExecutor(len(questions)) as pool:
        outs = list(pool.map(lambda q: smollm2.chat(messages=ask(q), response_format={"type": "json_object"}),
                             questions))
    for out in outs:
        text = out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop", text
        assert isinstance(json.loads(text), dict), text


def test_vllm_extras_and_completions(clusters):
    spec, _ = clusters
    choice = spec.chat(messages=ask("Yes or no?"), extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.choices[0].message.content in ("yes", "no", "maybe")
    regex = spec.chat(messages=ask("A code?"), extra_body={"structured_outputs": {"regex": "[a-z]{2,5}-[0-9]{1,3}"}})
    assert re.fullmatch("[a-z]{2,5}-[0-9]{1,3}", regex.choices[0].message.content)
    guided = spec.chat(messages=ask("A record?"), extra_body={"guided_json": SCHEMAS["enum"]})
    jsonschema.validate(json.loads(guided.choices[0].message.content), SCHEMAS["enum"])
    # The completions endpoint takes them too (as vLLM's does).
    comp = spec.http.completions.create(model="m", prompt="JSON:", max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"structured_outputs": {"json": SCHEMAS["nested"]}})
    jsonschema.validate(json.loads(comp.choices[0].text), SCHEMAS["nested"])


def test_the_sdk_takes_the_same_constraints_and_speculated(clusters):
    spec, plain = clusters
    msgs = ask("A stack program, as JSON.")
    with pdserve.Client(spec.router.address, timeout=TIMEOUT_S) as c:
        got = c.complete(msgs, max_tokens=MAX_TOKENS, temperature=0.0, response_format=json_schema_format("repeating"))
        vllm = c.complete(msgs, max_tokens=MAX_TOKENS, temperature=0.0, structured={"json": SCHEMAS["repeating"]})
    jsonschema.validate(json.loads(got.text), SCHEMAS["repeating"])
    assert got.text == vllm.text
    assert got.timings.transfer_s > 0  # prefilled (its first token sampled) on the prefill node
    assert got.usage.spec_draft_tokens > 0  # the decode node did speculate under the grammar
    ref = plain.chat(messages=msgs, response_format=json_schema_format("repeating"))
    assert got.text == ref.choices[0].message.content


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_calls(calls, only: str | None = None) -> list[tuple[str, dict]]:
    assert calls, "no tool call"
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in SCHEMA_OF and (only is None or c.function.name == only)
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMA_OF[c.function.name])  # the required arguments are there
        out.append((c.function.name, args))
    return out


def folded_stream(cluster, **kw):
    """A streamed answer folded as an OpenAI client folds deltas: (content, [(name, args)],
    finish reason, whether each call's first delta carried id, type and name)."""
    content, calls, finish = "", {}, None
    for chunk in cluster.http.chat.completions.create(model="m", temperature=0, max_tokens=MAX_TOKENS,
                                                      stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name and tc.function.arguments == ""
                calls[tc.index] = [tc.function.name, ""]
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index][1] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))], finish


def test_required_tool_calls_parse_streaming_and_not(clusters):
    # One call per answer: a random model given "parallel" calls would call until max_tokens.
    spec, plain = clusters
    kw = dict(messages=ask("What is the weather in Paris?"), tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False)
    a, b = both(clusters, **kw)
    msg = a.choices[0].message
    assert a.choices[0].finish_reason == "tool_calls", (msg.content, msg.tool_calls)
    calls = check_calls(msg.tool_calls)
    assert len(calls) == 1 and calls == check_calls(b.choices[0].message.tool_calls)
    content, streamed, finish = folded_stream(spec, **kw)
    assert (content or None, streamed, finish) == (msg.content, calls, "tool_calls")
    named = spec.chat(messages=kw["messages"], tools=TOOLS, tool_choice={"type": "function",
                                                                         "function": {"name": "get_time"}})
    assert len(check_calls(named.choices[0].message.tool_calls, only="get_time")) == 1
    with pdserve.Client(spec.router.address, timeout=TIMEOUT_S) as c:
        sdk = c.complete(kw["messages"], max_tokens=MAX_TOKENS, temperature=0.0, tools=TOOLS, tool_choice="required",
                         parallel_tool_calls=False)
    assert sdk.finish_reason == "tool_calls"
    assert [(t.name, t.parsed_arguments()) for t in sdk.tool_calls] == calls


def test_smollm2_calls_tools_in_its_own_format(smollm2):
    kw = dict(messages=ask("What is the weather in Paris, in celsius?"), tools=TOOLS, tool_choice="required")
    with ThreadPoolExecutor(2) as pool:  # one batch: the whole answer and the stream together
        whole = pool.submit(lambda: smollm2.chat(**kw))
        _, streamed, finish = pool.submit(lambda: folded_stream(smollm2, **kw)).result()
        out = whole.result()
    assert out.choices[0].finish_reason == "tool_calls", out.choices[0].message
    calls = check_calls(out.choices[0].message.tool_calls)
    assert (streamed, finish) == (calls, "tool_calls")


def test_a_tool_conversation_renders_and_none_never_parses(clusters):
    spec, _ = clusters
    first = spec.chat(messages=ask("Weather in Oslo?"), tools=TOOLS, tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    history = [*ask("Weather in Oslo?"),
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "deg": 3}'}]
    auto = spec.chat(messages=history, tools=TOOLS)  # "auto": text, or a call that parses
    if auto.choices[0].message.tool_calls:
        check_calls(auto.choices[0].message.tool_calls)
    none = spec.chat(messages=history, tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"},
                                                                 "strict": True}}}, None, "strnig"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "response_format",
     "guided_regex and response_format"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: ("}}}, None, "grammar"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
])
def test_bad_constraints_are_refused_with_a_400_naming_them(clusters, body, param, words):
    spec, _ = clusters
    with pytest.raises(openai.BadRequestError) as e:
        spec.chat(messages=ask("x"), **body)
    err = e.value.body
    assert words in err["message"], err
    if param is not None:
        assert err["param"] == param, err


def test_a_decode_node_killed_mid_json_answer_changes_nothing(clusters):
    """Last in the module: it kills one of ``spec``'s decode nodes."""
    spec, plain = clusters
    msgs = ask("A long stack program, as JSON, please.")
    ref = plain.chat(messages=msgs, response_format=json_schema_format("repeating"))
    for nid in ("decode-0", "decode-1"):
        spec.nodes[nid].aengine.step_delay_s = 0.1  # so that the kill lands mid-answer on every run
    text, finish, errors = [], [], []

    def run():
        try:
            with pdserve.Client(spec.router.address, timeout=TIMEOUT_S, retries=0) as c:
                with c.generate(msgs, max_tokens=MAX_TOKENS, temperature=0.0,
                                response_format=json_schema_format("repeating")) as stream:
                    for chunk in stream:
                        text.append(chunk.text)
                    finish.append(stream.completion.finish_reason)
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert wait_for(lambda: len("".join(text)) >= 4, timeout=TIMEOUT_S), "no JSON streamed"
    victim = max(("decode-0", "decode-1"), key=lambda n: spec.nodes[n].aengine.load.running)
    assert spec.nodes[victim].aengine.load.running > 0, "the answer finished before the kill"
    spec.nodes[victim].stop(deregister=False, grace_s=0)  # calls cut, engine gone, lease left to lapse
    t.join(TIMEOUT_S)
    assert not errors, errors
    assert "".join(text) == ref.choices[0].message.content
    jsonschema.validate(json.loads("".join(text)), SCHEMAS["repeating"])
    assert finish == ["stop"]
    moved = spec.router.orchestrator.metrics.registry.get_sample_value(
        "pdserve:request_migrations_total", {"model_name": "m", "reason": "decode_failed"})
    assert moved and moved >= 1  # the answer did move to the other decode node
