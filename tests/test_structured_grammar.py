"""Structured-output constraints as plain data and at the router: spec validation, the wire
(serving.proto and the kv.proto requests that embed it), the grammar text both sides compile
(tokens/grammar.py), the compile cache with its bounds (a real llguidance compile past the
time bound), the router's torch-free check, and the rejection sampler's exactness with a
grammar-masked target and a draft that proposes masked tokens."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from protos.convert import sampling_from_proto, sampling_to_proto
from protos.pdserve.v1 import kv_pb2
from protos.pdserve.v1 import serving_pb2 as pb
from tokens.grammar import GrammarCache, GrammarError, lark_regex, to_llguidance
from tokens.sampling_params import SamplingParamError, SamplingParams, StructuredOutput

SO = StructuredOutput


@pytest.mark.parametrize("so, match", [
    (SO("yaml", ""), "kind must be one of"),
    (SO("json_schema", "{not json"), "not valid JSON"),
    (SO("json_schema", "[1, 2]"), "must be a JSON object"),
    (SO("json_object", "{}"), "spec must be empty"),
    (SO("regex", "  "), "non-empty"),
    (SO("choice", "[]"), "non-empty JSON list"),
    (SO("choice", '["a", 3]'), "non-empty JSON list"),
    (SO("structural_tag", '{"structures": [], "triggers": ["<t>"]}'), "'structures'"),
    (SO("structural_tag", json.dumps({"structures": [{"begin": "<x>", "end": "", "schema": {}}],
                                      "triggers": ["<t>"]})), "must start with one of the triggers"),
    (SO("grammar", "x" * (StructuredOutput.MAX_SPEC_CHARS + 1)), "at most 65536 characters"),
])
def test_spec_validation_names_the_field(so, match):
    with pytest.raises(SamplingParamError, match=match) as err:
        SamplingParams(structured=so).validate()
    assert err.value.field == "structured"


def test_valid_specs_pass():
    for so in (SO("json_schema", '{"type": "object"}'), SO("json_schema", "true"), SO("json_object"),
               SO("regex", "[0-9]+"), SO("choice", '["a", "b"]'), SO("grammar", 'start: "x"'),
               SO("structural_tag", json.dumps({"structures": [{"begin": "<t>{", "end": "}</t>", "schema": {}}],
                                                "triggers": ["<t>"], "at_least_one": True}))):
        SamplingParams(structured=so).validate()


def test_the_wire_carries_it_to_both_roles_unchanged():
    for so in (SO("json_schema", '{"type": "object"}', strict=False), SO("structural_tag", '{"a": 1}'), None):
        p = SamplingParams(temperature=0.0, structured=so)
        msg = sampling_to_proto(p)
        for req in (kv_pb2.PrefillRequest(sampling=msg), kv_pb2.DecodeRequest(sampling=msg)):
            again = type(req).FromString(req.SerializeToString())
            assert sampling_from_proto(again.sampling) == p
    assert not sampling_to_proto(SamplingParams()).HasField("structured")
    # strict absent on the wire = true; an unset kind is refused by name.
    m = pb.SamplingParams(structured=pb.StructuredOutput(spec='{"type": "object"}'))
    got = sampling_from_proto(m)
    assert got.structured.strict is True
    with pytest.raises(SamplingParamError, match="'unspecified'"):
        got.validate()


def test_grammar_text():
    assert lark_regex("a/b\\/c") == "a\\/b\\/c"
    assert to_llguidance(SO("regex", "[a-z]+/x"), str) == "start: /[a-z]+\\/x/"
    assert to_llguidance(SO("choice", '["a", "b\\"c"]'), str) == 'start: "a" | "b\\"c"'
    strict = json.loads(to_llguidance(SO("json_schema", '{"type": "object", "x-guidance": {"item_separator": ","}}'),
                                      str))
    opts = strict["grammars"][0]["json_schema"]["x-guidance"]
    assert opts["item_separator"] == "," and opts["whitespace_flexible"] is False and "lenient" not in opts
    lenient = json.loads(to_llguidance(SO("json_schema", "true", strict=False), str))
    assert lenient["grammars"][0]["json_schema"]["x-guidance"]["lenient"] is True
    assert to_llguidance(SO("grammar", "root ::= x"), lambda g: "converted") == "converted"


def test_cache_is_lru_and_remembers_refusals():
    cache = GrammarCache(size=2)
    calls = []

    def compile_as(value):
        def fn():
            calls.append(value)
            if value == "bad":
                raise ValueError("Unimplemented keys: [\"not\"]")
            return value
        return fn

    assert cache.get("a", compile_as("a")) == "a"
    assert cache.get("b", compile_as("b")) == "b"
    assert cache.get("a", compile_as("a2")) == "a"  # hit; "a" is now the most recent
    cache.get("c", compile_as("c"))  # evicts "b", the least recent
    assert cache.get("b", compile_as("b2")) == "b2"
    assert calls == ["a", "b", "c", "b2"]
    for _ in range(2):
        with pytest.raises(GrammarError, match="Unimplemented keys"):
            cache.get("x", compile_as("bad"))
    assert calls.count("bad") == 1  # refused once, then from the negative cache


@pytest.fixture(scope="module")
def prompt_tokenizer(tok_dir):
    from router.tokenizer import PromptTokenizer
    return PromptTokenizer(tok_dir)


def test_compile_time_bound_with_a_real_compile(prompt_tokenizer):
    """A real llguidance compile (a schema of 300 properties, ~10+ ms) under a 1 ms bound: refused
    naming the bound, and refused again at once (negative cache) while the first compile may
    still be running."""
    from router.structured import StructuredChecker

    checker = StructuredChecker(prompt_tokenizer, cache=GrammarCache(timeout_s=0.001))
    big = json.dumps({"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"^v{i}[a-z]{{2,9}}$"}
                                                       for i in range(300)}, "required": [f"field_{i}" for i in range(300)]})
    for _ in range(2):
        with pytest.raises(GrammarError, match="more than 0.001 s .the compile-time bound."):
            checker.check(SO("json_schema", big))


def test_abandoned_compiles_are_bounded():
    """Compiles past the bound cannot be stopped: past max_abandoned of them, new ones are
    refused (busy) instead of piling up threads; once they finish, compiles run again."""
    cache = GrammarCache(timeout_s=0.01, max_abandoned=2)
    release = threading.Event()
    try:
        for key in ("s1", "s2"):
            with pytest.raises(GrammarError, match="compile-time bound"):
                cache.get(key, lambda: release.wait(10))
        with pytest.raises(GrammarError, match="busy: 2 compiles"):
            cache.get("s3", lambda: "never runs")
    finally:
        release.set()
    for _ in range(200):
        if cache._abandoned == 0:
            break
        threading.Event().wait(0.01)
    assert cache.get("s3", lambda: "ok") == "ok"


def test_router_check_names_what_it_refuses(prompt_tokenizer):
    from router.structured import StructuredChecker

    checker = StructuredChecker(prompt_tokenizer)
    for so, match in ((SO("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
                      (SO("json_schema", '{"not": {"type": "string"}}'), "not"),
                      (SO("json_schema", '{"$ref": "#/$defs/missing"}'), "does not exist"),
                      (SO("regex", "(a"), "unclosed group"),
                      (SO("grammar", "start: nothing_here"), "unknown name")):
        with pytest.raises(GrammarError, match=match) as err:
            checker.check(so)
        assert err.value.field == "structured"
    checker.check(SO("json_schema", '{"type": "array", "uniqueItems": true}', strict=False))
    checker.check(SO("grammar", 'root ::= "a" | "b"'))  # GBNF
    checker.check(SO("structural_tag", json.dumps({
        "structures": [{"begin": "<tool_call>", "end": "</tool_call>",
                        "schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "triggers": ["<tool_call>"]})))


def test_rejection_sampling_stays_exact_with_a_masked_target():
    """p: the target masked by the grammar (tokens 3 and 4 refused); q: a draft distribution
    that puts mass on them. The engine keeps a refused sampled draft as the last draft, so the
    verification rejects it for sure and draws from norm(max(p - q, 0)): the first emitted
    token is p-distributed. (Dropping the refused draft and drawing from p instead would give
    p + q(refused) * (p - residual), biased.)"""
    from engine.speculative.rejection_sampler import verify_drafts

    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0])
    q = torch.tensor([0.1, 0.1, 0.1, 0.4, 0.3])
    gen = torch.Generator().manual_seed(0)
    n = 6000
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).tolist()
    uniforms = torch.rand((n, 2, 2), generator=gen)
    counts = torch.zeros(5)
    target = torch.stack([p, p])  # [k + 1, V]: the bonus row is never read when the draft is refused
    for d, u in zip(drafts, uniforms):
        n_acc, nxt = verify_drafts([d], target, q.unsqueeze(0), u, greedy=False)
        counts[d if n_acc else nxt] += 1
    freq = counts / n
    assert freq[3] == 0 and freq[4] == 0
    assert torch.allclose(freq, p, atol=0.025), freq
