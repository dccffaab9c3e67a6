"""Constrained decoding through the engine: a tiny random model with SmolLM2's vocabulary and
its real tokenizer, llguidance masks. Every output parses and validates with ``jsonschema``;
greedy outputs are identical with speculation on and off (n-gram and draft proposers), across
a prefill -> decode hand-off and after a resume (migration), and with the masks filled serially,
in parallel or overlapped with the forward; n > 1 samples each keep their own grammar; the
prefix cache is keyed by tokens only; refused constraints name what is refused.

A random model never closes a free string, so every schema here bounds its strings (enum,
pattern, maxLength) and uses additionalProperties false: the grammar, not the model, ends the
output, well inside max_tokens.
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import jsonschema
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.models.tiny import save_tiny_model
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.speculative.proposers import build_proposer
from engine.structured.decoding import FillMode
from tokens.sampling_params import SamplingParams, StructuredOutput

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
     "required": ["name", "age", "tags"], "additionalProperties": False},
    {"type": "object", "$defs": {"pt": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x"], "additionalProperties": False}},
     "properties": {"p": {"$ref": "#/$defs/pt"}, "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}]}},
     "required": ["p", "note"], "additionalProperties": False},
    {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "ok": {"type": "boolean"},
        "level": {"enum": ["low", "high"]}},
     "required": ["code", "ok", "level"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
                                "required": ["id"], "additionalProperties": False},
     "minItems": 2, "maxItems": 2},
]


def json_params(schema, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 120, **kw},
                          structured=StructuredOutput("json_schema", json.dumps(schema)))


def assert_valid(outputs, schemas):
    for out, schema in zip(outputs, schemas):
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.finish_reason, c.text)
            jsonschema.validate(json.loads(c.text), schema)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tok_dir):
    from pathlib import Path
    root = tmp_path_factory.mktemp("structured")
    target = save_tiny_model(root / "target", vocab_size=49152, seed=5)
    draft = save_tiny_model(root / "draft", vocab_size=49152, seed=6, num_hidden_layers=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tok_dir) / name).exists():
            shutil.copy(Path(tok_dir) / name, target / name)
    return {"target": target, "draft": draft}


def make_engine(models, spec: SpeculativeConfig = SpeculativeConfig()) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(models["target"]), dtype="float32", device="cpu",
                                  cache=CacheConfig(block_size=4, num_blocks=1024), speculative=spec),
                     proposer_factory=build_proposer)


@pytest.fixture(scope="module")
def engine(models):
    return make_engine(models)


# Examples in the prompt give n-gram lookup valid drafts to propose (some accepted, some not).
EXAMPLES = ('{"name": "ab", "age": 12, "tags": ["a", "b"]} {"p": {"x": 1}, "note": null} '
            '{"code": "ABC-12", "ok": true, "level": "low"} [{"id": 1}, {"id": 2}]')


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.encode(f"Reply in JSON like {EXAMPLES}", chat=True)


@pytest.fixture(scope="module")
def reference(engine, prompt):
    """Greedy constrained outputs of the plain engine, one per schema."""
    outs = engine.generate([prompt] * len(SCHEMAS), [json_params(s) for s in SCHEMAS])
    assert_valid(outs, SCHEMAS)
    return [o.outputs[0].token_ids for o in outs]


def test_every_output_parses_and_validates(engine, prompt, reference):
    sampled = engine.generate([prompt] * len(SCHEMAS),
                              [json_params(s, temperature=1.0, seed=i) for i, s in enumerate(SCHEMAS)])
    assert_valid(sampled, SCHEMAS)
    assert engine.kv.num_free_blocks == engine.num_blocks and not engine.structured.active


def test_logprobs_are_of_the_constrained_distribution(engine, prompt):
    so = StructuredOutput("choice", json.dumps(["yes", "no"]))
    rid = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=5,
                                                                         logprobs=20, structured=so))
    tops = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                tops += out.outputs[0].new_top_logprobs or []
    first = tops[0]  # every spelling the grammar allows ("y", "ye", "yes", "n", "no"), nothing else
    assert first and all(v > float("-inf") for _, v in first)
    assert all(any(w.startswith(engine.tokenizer.decode([t])) for w in ("yes", "no")) for t, _ in first)
    assert abs(sum(math.exp(v) for _, v in first) - 1.0) < 1e-4


def test_other_kinds_end_when_the_grammar_does(engine, prompt):
    cases = [
        (StructuredOutput("choice", json.dumps(["yes", "no"])), lambda t: t in ("yes", "no")),
        (StructuredOutput("regex", "[a-z]{3}-[0-9]"), lambda t: len(t) == 5 and t[3] == "-"),
        (StructuredOutput("grammar", 'start: "(" NUM ("," NUM)? ")"\nNUM: /[0-9]/'),
         lambda t: t.startswith("(") and t.endswith(")")),
        (StructuredOutput("grammar", 'root ::= "<" [a-c] [a-c] ">"'), lambda t: len(t) == 4),  # GBNF
    ]
    outs = engine.generate([prompt] * len(cases), [SamplingParams(temperature=0.0, max_tokens=30, structured=so)
                                                   for so, _ in cases])
    for (so, ok), out in zip(cases, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and ok(c.text), (so, c.text)
        assert engine.eos_token_ids[0] not in c.token_ids  # ended by the grammar, not by sampling EOS


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identical_with_speculation(models, prompt, reference, method):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, adaptive=False,
                             draft_model=str(models["draft"]) if method == "draft" else None, draft_dtype="float32")
    eng = make_engine(models, spec)
    outs = eng.generate([prompt] * len(SCHEMAS), [json_params(s) for s in SCHEMAS])
    assert [o.outputs[0].token_ids for o in outs] == reference
    if method == "ngram":
        st = eng.stats()["speculative"]
        assert st["drafts"] > 0 and 0 < st["accepted_tokens"] < st["draft_tokens"]  # accepted and rolled back
    else:  # sampled drafts (draft probs q): a refused draft token stays as a surely-rejected last one
        sampled = eng.generate([prompt] * len(SCHEMAS), [json_params(s, temperature=1.0, seed=3) for s in SCHEMAS])
        assert_valid(sampled, SCHEMAS)
        assert eng.stats()["speculative"]["drafts"] > 0
    assert eng.kv.num_free_blocks == eng.num_blocks and not eng.structured.active


@pytest.mark.parametrize("method", [None, "ngram"])
def test_outputs_identical_with_parallel_fill_on_and_off(models, prompt, reference, method):
    """Greedy and seeded sampled outputs, with their logprobs, are the same whichever way the
    masks are filled; with n-gram drafts the waves walk drafts of several sequences at once.
    One fresh engine per mode: a second run on the same engine would hit the prefix cache."""
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, adaptive=False) if method else SpeculativeConfig()
    params = [json_params(s, logprobs=2) for s in SCHEMAS] + [
        json_params(s, temperature=1.0, seed=i, logprobs=2) for i, s in enumerate(SCHEMAS)]
    runs = {}
    for mode in FillMode:
        eng = make_engine(models, spec)
        eng.structured.fill = mode
        outs = eng.generate([prompt] * len(params), params)
        runs[mode] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        assert not eng.structured.active
        if method:
            assert eng.stats()["speculative"]["drafts"] > 0
    assert runs[FillMode.SERIAL] == runs[FillMode.PARALLEL] == runs[FillMode.OVERLAP]


def test_an_overlapped_fill_is_waited_for_before_the_matchers_move(engine, prompt):
    """A step whose forward never applied its masks (it failed) leaves a fill running: the next
    use of the matchers waits for it; its rows are the serial fill's. (One row is filled at
    once; three go to the fill's thread.)"""
    sd = engine.structured
    so = StructuredOutput("json_schema", json.dumps(SCHEMAS[2]))
    items = []
    for i in range(3):
        seq = Sequence(f"overlap{i}", 0, list(prompt), len(prompt), json_params(SCHEMAS[2]), 0.0)
        sd.add(seq.seq_id, so, [])
        items.append(ScheduledSeq(seq, 0, len(prompt), sample=True))
    try:
        sd.fill = FillMode.SERIAL
        want = sd.prepare(items).rows.clone()
        sd.fill = FillMode.OVERLAP
        masks = sd.prepare(items)
        assert masks.pending is not None
        first = engine.encode('{"code"', chat=False)[0]
        assert sd.advance(items[0].seq.seq_id, [first]) is None  # waited, then advanced
        masks.wait()
        assert torch.equal(masks.rows, want)
    finally:
        sd.fill = FillMode.OVERLAP
        sd.forget(*(it.seq.seq_id for it in items))


def test_resumed_request_continues_identically(engine, prompt, reference):
    """As after a migration: the prompt carries the first N outputs (resumed_output_tokens),
    the grammar is advanced over them, and the continuation is the fault-free one."""
    for i, n in ((0, 5), (2, 9)):
        want = reference[i]
        assert want[:n] + _resume(engine, prompt, want[:n], json_params(SCHEMAS[i])) == want
    with pytest.raises(InvalidRequestError, match="does not match"):
        bad = engine.encode("not json", chat=False)[:2]
        _resume(engine, prompt, bad, json_params(SCHEMAS[0]))


def _resume(eng, prompt, done, params):
    rid = eng.add_request(prompt_token_ids=prompt + done, params=params, resumed_output_tokens=len(done))
    got = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid:
                got += out.outputs[0].new_token_ids
    return got


def test_prefill_then_decode_samples_under_the_mask_on_both(models, prompt, reference):
    """The disaggregated path without the network (as tests/test_engine.py): the prefill
    engine samples the first token under the mask, the decode engine's matcher is advanced over
    it (and over resumed outputs) before it samples; the output equals one engine's."""
    p_eng, d_eng = make_engine(models), make_engine(models)
    for i, resumed in ((0, 0), (1, 4)):
        params = json_params(SCHEMAS[i])
        done = reference[i][:resumed]
        first = _prefill(p_eng, prompt + done, params, resumed)
        rid = f"r{i}"
        dst, _ = d_eng.reserve_kv(rid, prompt + done)
        d_eng.kv_cache[:, dst] = p_eng.kv_cache[:, p_eng.held_block_table(first.request_id)]
        p_eng.release_kv(first.request_id)
        firsts = first.outputs[0].token_ids[resumed:]
        d_eng.add_prefilled_request(rid, prompt + done, firsts, params, resumed_output_tokens=resumed)
        got = []
        while d_eng.has_unfinished_requests():
            for out in d_eng.step():
                got += out.outputs[0].new_token_ids
        assert done + got == reference[i]
    assert d_eng.kv.num_free_blocks == d_eng.num_blocks and not d_eng.structured.active


def _prefill(eng, tokens, params, resumed):
    rid = eng.add_request(prompt_token_ids=tokens, params=replace(params, max_tokens=resumed + 1, min_tokens=0),
                          hold_kv=True, resumed_output_tokens=resumed)
    while True:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out


def test_n_samples_each_keep_their_own_grammar(engine, prompt):
    out = engine.generate([prompt], [json_params(SCHEMAS[0], n=3, temperature=1.0, seed=9)])[0]
    assert len(out.outputs) == 3
    assert_valid([out], [SCHEMAS[0]])
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # three samples, not one copied


def test_prefix_cache_is_keyed_by_tokens_only(engine, prompt, reference):
    """A constrained run's KV is ordinary KV: a plain request over the same tokens hits it."""
    full = prompt + reference[3]
    before = engine.kv.pool.prefix_hit_tokens
    engine.generate([full], SamplingParams(temperature=0.0, max_tokens=1))
    hit = engine.kv.pool.prefix_hit_tokens - before
    assert hit >= (len(full) - 1) // engine.block_size * engine.block_size - engine.block_size


def test_refused_constraints_name_the_construct(engine, prompt, models):
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        engine.add_request(prompt_token_ids=prompt, params=json_params({"type": "array", "uniqueItems": True}))
    with pytest.raises(InvalidRequestError, match="unknown name"):
        engine.add_request(prompt_token_ids=prompt, params=SamplingParams(
            structured=StructuredOutput("grammar", "start: nothing_here")))
    # strict=False (OpenAI's non-strict json_schema): the keyword is ignored, the rest enforced.
    lenient = replace(json_params({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "maxItems": 2}),
                      structured=StructuredOutput("json_schema", json.dumps(
                          {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "maxItems": 2}),
                          strict=False))
    out = engine.generate([prompt], lenient)[0].outputs[0]
    assert all(v in (1, 2) for v in json.loads(out.text))
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.num_blocks
    bare = LLMEngine(EngineConfig(model=str(models["target"]), dtype="float32", device="cpu",
                                  cache=CacheConfig(num_blocks=64)), load_tokenizer=False)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        bare.add_request(prompt_token_ids=prompt, params=json_params(SCHEMAS[0]))
