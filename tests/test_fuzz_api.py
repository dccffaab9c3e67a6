"""The router's client APIs, fuzzed (hypothesis) against a live router with a small cluster
(real Redis, one prefill and one decode node on a tiny random model, SmolLM2's tokenizer):

- gRPC: raw bytes (malformed, truncated, non-UTF-8, unknown fields) sent as they are to every
  PdServe method, and well-formed requests with any value in any field (NaN and inf floats,
  integers at and past their limits, huge prompts, empty prompts, unknown enum values);
- the SDK: any Python value for its keywords;
- HTTP: OpenAI request bodies with any value of any JSON type, and bodies that are not JSON.

Every answer is a completed stream or a clear refusal: INVALID_ARGUMENT / HTTP 400 in OpenAI's
shape naming the field (NOT_FOUND / 404 for an unknown model), never UNKNOWN, INTERNAL or 500.
After each batch a normal request still succeeds: nothing crashed or wedged.
"""
from __future__ import annotations

import http.client
import json
import math
import re
import uuid

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import pdserve
from protos.pdserve.v1 import serving_pb2 as pb
from tests.clusters import start_node, start_router
from tests.helpers import engine_config, wait_for

MAX_LEN = 256
VOCAB = 49152  # SmolLM2's tokenizer, and so the tiny model's
# Deterministic and bounded (the module runs in well under a minute on 2 cores); no example
# database is written into the checkout.
FUZZ = settings(max_examples=60, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# Words an INVALID_ARGUMENT may lead with: a field of the request, or a limit named after one.
NAMES_A_FIELD = re.compile(
    r"\b(n|max_tokens|min_tokens|temperature|top_k|top_p|min_p|repetition_penalty|presence_penalty|"
    r"frequency_penalty|logprobs|stop|stop_token_ids|seed|token ids|prompt|chat|messages|text|tokens|"
    r"max_prompt_tokens|max_model_len|max_tokens_limit|request_id)\b|field [#a-z_]")
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


@pytest.fixture(scope="module")
def cluster(redis_url, tok_dir, tmp_path_factory):
    from engine.models.tiny import save_tiny_model

    model = save_tiny_model(tmp_path_factory.mktemp("tiny-fuzz"), vocab_size=VOCAB)
    ns = f"fuzz-{uuid.uuid4().hex[:6]}"
    eng = engine_config(model, num_blocks=256)
    nodes = [start_node(role, f"fz-{role}", eng, redis_url=redis_url, namespace=ns, lease_s=1.5, heartbeat_s=0.2,
                        grpc_workers=8) for role in ("decode", "prefill")]
    router = start_router(redis_url, tok_dir, namespace=ns, http_port=0, max_model_len=MAX_LEN, short_prompt_tokens=32)
    with pdserve.Client(router.address) as c:
        wait_for(c.health, timeout=30, every=0.1)
    yield router
    router.stop()
    for n in nodes:
        n.stop()


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(cluster.address) as ch:
        yield ch


def assert_still_serving(router) -> None:
    """A normal request after a fuzz batch: short (decode node prefills) and long (disaggregated)."""
    with pdserve.Client(router.address, timeout=60) as c:
        for ids in ([5, 6, 7], [(i * 13) % 400 + 3 for i in range(40)]):
            out = c.complete(token_ids=ids, max_tokens=3, temperature=0.0, ignore_eos=True)
            assert len(out.token_ids) == 3 and out.finish_reason == "length"


def raw_call(channel, method: str, data: bytes):
    """Bytes sent as they are (identity serializers); returns (code, details, responses)."""
    call = (channel.unary_stream if method == "Generate" else channel.unary_unary)(f"/pdserve.v1.PdServe/{method}")
    try:
        out = call(data, timeout=60)
        return grpc.StatusCode.OK, "", list(out) if method == "Generate" else [out]
    except grpc.RpcError as e:
        return e.code(), e.details(), []


def check_refusal(code: grpc.StatusCode, details: str) -> None:
    assert code in REFUSALS, f"{code.name}: {details}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert NAMES_A_FIELD.search(details), f"names no field: {details}"


# ----------------------------------------------------------------------------- gRPC: raw bytes
VALID = pb.GenerateRequest(
    chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="héllo")]),
    sampling=pb.SamplingParams(max_tokens=2, temperature=0.0, stop=["x"]), request_id="base").SerializeToString()


@st.composite
def mangled(draw) -> bytes:
    """A valid request's bytes cut, flipped, spliced with junk, or junk alone."""
    data = bytearray(VALID)
    kind = draw(st.sampled_from(["truncate", "flip", "splice", "junk", "unknown_field"]))
    if kind == "truncate":
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    if kind == "flip":
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        return bytes(data)
    if kind == "splice":
        i = draw(st.integers(0, len(data)))
        return bytes(data[:i]) + draw(st.binary(min_size=1, max_size=40)) + bytes(data[i:])
    if kind == "unknown_field":  # field 100, any wire type: proto3 keeps it as unknown
        return bytes(data) + draw(st.sampled_from([b"\xa0\x06\x01", b"\xa2\x06\x02hi", b"\xa5\x06\x00\x00\x00\x00"]))
    return draw(st.binary(max_size=120))


def test_raw_bytes_to_every_method_are_parsed_or_refused_by_field(cluster, channel):
    @FUZZ
    @given(mangled(), st.sampled_from(["Generate", "Generate", "Abort", "ListModels"]))
    def run(data, method):
        code, details, out = raw_call(channel, method, data)
        event(code.name)  # --hypothesis-show-statistics shows the mix
        if code == grpc.StatusCode.OK:
            return
        check_refusal(code, details)
        try:
            pb.GenerateRequest.FromString(data) if method == "Generate" else pb.AbortRequest.FromString(data)
        except Exception:  # bytes protobuf refuses: the refusal says where they broke
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "is not a valid pdserve.v1." in details, details

    run()
    assert_still_serving(cluster)


def test_named_malformations(cluster, channel):
    bad_utf8 = pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="abc")]))
    raw = bad_utf8.SerializeToString().replace(b"abc", b"a\xffc")
    code, details, _ = raw_call(channel, "Generate", raw)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "field chat.messages[0].content: is not valid UTF-8" in details
    code, details, _ = raw_call(channel, "Generate", VALID[:-3])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "truncated" in details, details
    code, details, _ = raw_call(channel, "Abort", b"\x0a\x05ab")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "field request_id" in details, details
    code, _, out = raw_call(channel, "Generate", VALID + b"\xa2\x06\x02hi")  # an unknown field: served
    assert code == grpc.StatusCode.OK and pb.GenerateResponse.FromString(out[-1]).WhichOneof("kind") == "complete"


# ----------------------------------------------------------------------------- gRPC: any value
f32 = st.floats(width=32)  # NaN, inf, -0.0, subnormals: whatever the wire carries


def small_or_any(lo: int, hi: int, small: tuple[int, int]):
    """Mostly small values (valid ones run), the field's bounds, and anything between."""
    return st.one_of(st.integers(*small), st.sampled_from([lo, hi]), st.integers(lo, hi))


PROMPTS = st.one_of(
    st.text(max_size=60).map(lambda t: ("text", t)),
    st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", "", "tool"]), st.text(max_size=30)),
             max_size=3).map(lambda m: ("chat", m)),
    st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(0, (1 << 32) - 1)), max_size=40).map(
        lambda ids: ("tokens", ids)),
    st.sampled_from([("text", "ab " * 40_000), ("tokens", [7] * 5000), ("text", ""), ("none", None)]),
)
SAMPLING = st.fixed_dictionaries({}, optional={
    "n": small_or_any(0, (1 << 32) - 1, (1, 3)),
    "max_tokens": small_or_any(0, (1 << 32) - 1, (1, 4)),
    "min_tokens": small_or_any(0, (1 << 32) - 1, (0, 2)),
    "temperature": f32, "top_p": f32, "min_p": f32, "repetition_penalty": f32,
    "presence_penalty": f32, "frequency_penalty": f32,
    "top_k": small_or_any(-(1 << 31), (1 << 31) - 1, (-2, 10)),
    "seed": st.integers(0, (1 << 64) - 1),
    "logprobs": small_or_any(0, (1 << 32) - 1, (0, 3)),
    "stop": st.lists(st.text(max_size=5), max_size=20),
    "stop_token_ids": st.lists(st.integers(0, (1 << 32) - 1), max_size=3),
    "ignore_eos": st.booleans(),
})
REQUESTS = st.fixed_dictionaries({
    "prompt": PROMPTS, "sampling": SAMPLING,
    "model": st.sampled_from(["", "", "m", "other"]),
    "slo_class": st.integers(0, 9),  # unknown values of an open enum
})


def build(r: dict) -> pb.GenerateRequest:
    req = pb.GenerateRequest(model=r["model"], slo_class=r["slo_class"], sampling=pb.SamplingParams(**r["sampling"]))
    kind, value = r["prompt"]
    if kind == "text":
        req.text = value
    elif kind == "chat":
        req.chat.messages.extend(pb.ChatMessage(role=a, content=b) for a, b in value)
    elif kind == "tokens":
        req.tokens.ids.extend(value)
    return req


def test_any_field_value_completes_or_is_refused_by_name(cluster, channel):
    gen = channel.unary_stream("/pdserve.v1.PdServe/Generate", request_serializer=pb.GenerateRequest.SerializeToString,
                               response_deserializer=pb.GenerateResponse.FromString)

    @FUZZ
    @given(REQUESTS)
    def run(r):
        s = r["sampling"]
        bounded = s.get("n", 1) <= 3 and s.get("max_tokens", 16) <= 16  # keep valid ones short
        if not bounded:
            s["logprobs"] = 100  # invalid anyway (logprobs > 20): a refusal, not a long run
        try:
            out = list(gen(build(r), timeout=60))
        except grpc.RpcError as e:
            event(e.code().name)
            check_refusal(e.code(), e.details())
            bad_float = [k for k in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                     "frequency_penalty") if k in s and not math.isfinite(s[k])]
            if bad_float and e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                assert "finite" in e.details() or any(k in e.details() for k in ("prompt", "token", "chat")), \
                    e.details()
            return
        event("OK")
        kinds = [m.WhichOneof("kind") for m in out]
        assert kinds and kinds[-1] == "complete" and "error" not in kinds, out[-3:]
        for k in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            assert k not in s or math.isfinite(s[k]), f"served with {k}={s[k]}"

    run()
    assert_still_serving(cluster)


def test_limits_are_refused_with_the_field_and_the_limit(cluster):
    with pdserve.Client(cluster.address, retries=0, timeout=60) as c:
        for kwargs, words in [
            (dict(max_tokens=MAX_LEN), "max_tokens (256) = 259 exceeds"),
            (dict(n=17), "n must be between 1 and 16, got 17"),
            (dict(temperature=float("nan")), "temperature must be a finite number"),
            (dict(stop=["x"] * 17), "stop may hold at most 16 strings, got 17"),
            (dict(stop=["ok", "x" * 257]), "stop strings may have at most 256 characters; stop[1] has 257"),
        ]:
            with pytest.raises(pdserve.InvalidRequestError, match=re.escape(words)):
                c.complete_all(token_ids=[1, 2, 3], **kwargs)
        with pytest.raises(pdserve.InvalidRequestError, match="characters: more than the 255 tokens"):
            c.complete("word " * 100_000)  # refused before it is tokenized
        with pytest.raises(pdserve.InvalidRequestError, match="the prompt has 5000 tokens"):
            c.complete(token_ids=[9] * 5000)
        with pytest.raises(pdserve.InvalidRequestError, match="chat prompt has 300 messages"):
            c.complete([{"role": "user", "content": ""}] * 300)  # refused before the template renders


# ----------------------------------------------------------------------------- the SDK
ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(), st.text(max_size=5),
                      st.just("\ud800"), st.lists(st.integers(-3, 3), max_size=2))
SDK_KWARGS = st.fixed_dictionaries({}, optional={k: ANY_VALUE for k in (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "logprobs", "min_tokens",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos", "stop", "stop_token_ids")})
SDK_PROMPTS = st.one_of(st.text(max_size=10), st.just("bad \udcff"), st.lists(st.integers(-2, 600), max_size=4),
                        st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": ANY_VALUE}), max_size=2),
                        st.integers())


def test_sdk_checks_what_the_wire_cannot_carry_before_sending(cluster):
    with pdserve.Client(cluster.address, retries=0, timeout=60) as c:
        @FUZZ
        @given(SDK_PROMPTS, SDK_KWARGS)
        def run(prompt, kwargs):
            if kwargs.get("n") not in (None, 1, 2) or not isinstance(kwargs.get("max_tokens", 1), int | None) \
                    or (kwargs.get("max_tokens") or 1) > 8:
                kwargs["logprobs"] = 99  # whatever else, refuse rather than run a long request
            try:
                c.complete_all(prompt, **kwargs)
                event("OK")
            except pdserve.InvalidRequestError as e:
                event("refused here" if e.field is not None else "refused by the server")
                if e.field is not None:  # refused here: the message leads with the field
                    assert e.message.startswith(e.field.split("[")[0]) or e.field == "prompt", e.message
                else:
                    assert NAMES_A_FIELD.search(e.message), e.message
            except pdserve.NotFoundError:
                pass

        run()
    assert_still_serving(cluster)


def test_sdk_names_the_field_instead_of_protobufs_value_out_of_range(cluster):
    with pdserve.Client(cluster.address, retries=0) as c:
        for kwargs, words in [(dict(max_tokens=-1), "max_tokens must be between 1 and 4294967295, got -1"),
                              (dict(max_tokens=1 << 40), "max_tokens must be between 1 and 4294967295"),
                              (dict(n=0), "n must be between 1"), (dict(seed=-5), "seed must be between 0"),
                              (dict(top_p=float("inf")), "top_p must be a finite number"),
                              (dict(stop_token_ids=[-1]), "stop_token_ids[0] must be between 0")]:
            with pytest.raises(pdserve.InvalidRequestError, match=re.escape(words)) as err:
                c.complete_all("hi", **kwargs)
            assert isinstance(err.value, ValueError) and err.value.field is not None
        with pytest.raises(pdserve.InvalidRequestError, match="messages is empty"):
            c.complete([])


# ----------------------------------------------------------------------------- HTTP
class Http:
    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = self.conn.getresponse()
        return r.status, r.read()


def check_http(status: int, body: bytes) -> None:
    assert status in (200, 400, 404), (status, body[:300])
    if status != 200:
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
        if status == 400:
            assert err["param"] or NAMES_A_FIELD.search(err["message"]) or "body" in err["message"], err


JSON_ANY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(1 << 66), 1 << 66), st.floats(),
                                  st.text(max_size=8)),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                    max_size=2), max_leaves=6)
PLAUSIBLE = {  # values a client would send, so that some requests are served
    "n": st.integers(1, 2), "max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "seed": st.integers(0, 1 << 63),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "stop": st.text(min_size=1),
    "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 2), "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=2),
    "logprobs": st.booleans(), "model": st.sampled_from(["m", ""]), "stream": st.booleans(),
    "slo_class": st.sampled_from(["interactive", "batch", "relaxed"]),
}
JUNK = st.one_of(JSON_ANY, st.integers(-(1 << 40), 1 << 40), st.sampled_from([math.nan, math.inf, -math.inf]))


@st.composite
def chat_fields(draw) -> dict:
    """Plausible values for some fields, then junk in none, one or several of them."""
    body = draw(st.fixed_dictionaries({}, optional=PLAUSIBLE))
    for key in draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), max_size=2)):
        body[key] = draw(JUNK)
    return body


_VALID_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                 "content": st.text(min_size=1, max_size=20)}), min_size=1, max_size=2)
MESSAGES = st.one_of(_VALID_MESSAGES, _VALID_MESSAGES, _VALID_MESSAGES,
                     st.lists(st.fixed_dictionaries({"role": JSON_ANY, "content": JSON_ANY}), max_size=2), JSON_ANY)


def _json_bytes(body: dict, lone_surrogate: bool) -> bytes:
    if lone_surrogate:
        body["user"] = "\ud800"  # json.dumps escapes it as JSON allows; no UTF-8 string can hold it
    return json.dumps(body).encode()  # NaN and Infinity as Python's json writes them


def test_http_bodies_of_any_shape_are_answered_in_openai_shape(cluster):
    client = Http(cluster.http_address)

    @FUZZ
    @given(MESSAGES, chat_fields(), st.integers(0, 9), st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    def run(messages, body, one_in_ten, path):
        body["messages"] = messages
        lone_surrogate = one_in_ten == 0
        if path == "/v1/completions":
            body["prompt"] = body.pop("messages")
            if isinstance(body["prompt"], list) and body["prompt"] and isinstance(body["prompt"][0], dict):
                body["prompt"] = [m.get("content") if isinstance(m, dict) else m for m in body["prompt"]]
            body.pop("top_logprobs", None)
            if isinstance(body.get("logprobs"), bool):
                body["logprobs"] = int(body["logprobs"])
        body.setdefault("max_tokens", 2)  # a chat default would use the whole context
        status, answer = client.post(path, _json_bytes(body, lone_surrogate))
        event(str(status))
        check_http(status, answer)

    run()

    @FUZZ
    @given(st.binary(max_size=80))
    def raw(data):
        check_http(*client.post("/v1/chat/completions", data))

    raw()
    assert_still_serving(cluster)


def test_http_names_the_field(cluster):
    client = Http(cluster.http_address)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for body, status, param in [
        ({**chat, "max_tokens": -1}, 400, "max_tokens"), ({**chat, "max_tokens": 1 << 40}, 400, "max_tokens"),
        ({**chat, "n": 1 << 40}, 400, "n"), ({**chat, "top_k": 1 << 31}, 400, "top_k"),
        ({**chat, "temperature": float("nan")}, 400, "temperature"),
        ({**chat, "repetition_penalty": float("inf")}, 400, "repetition_penalty"),
        ({**chat, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
        ({"messages": []}, 400, "messages"), ({"prompt": [-1]}, 400, "prompt"), ({"prompt": ""}, 400, "prompt"),
        ({"messages": [{"role": "user", "content": "x" * 200_000}]}, 400, "messages"),
    ]:
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        got, raw = client.post(path, json.dumps(body).encode())
        err = json.loads(raw)["error"]
        assert (got, err["param"]) == (status, param), (body.keys(), got, err)
    got, raw = client.post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
    assert got == 400 and json.loads(raw)["error"]["param"] == "messages.0.content"
    got, raw = client.post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff"}]}')
    assert got == 400 and json.loads(raw)["error"]["code"] == "invalid_body"
    got, raw = client.post("/v1/chat/completions", b'{"messages": [')
    assert got == 400 and "not valid JSON" in json.loads(raw)["error"]["message"]


def test_http_refuses_a_body_over_the_message_limit_before_reading_it(cluster):
    client = Http(cluster.http_address)
    client.conn.putrequest("POST", "/v1/chat/completions")
    client.conn.putheader("Content-Type", "application/json")
    client.conn.putheader("Content-Length", str((64 << 20) + 1))  # then sends none of it
    client.conn.endheaders()
    r = client.conn.getresponse()
    err = json.loads(r.read())["error"]
    assert r.status == 413 and err["code"] == "body_too_large" and "max_body_bytes" in err["message"]
    client.conn.close()
