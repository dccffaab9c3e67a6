"""The pieces of `pdserve bench structured` (its quick run end to end is in
tests/test_bench_quick.py): the real schemas' data file and where it came from, the request
sets, the cold variant's fresh schemas, the stepping that times decode steps only, and the
per-part replay over the engine's own grammar code."""
from __future__ import annotations

import json

import jsonschema
import pytest

from bench.structured_decode import stepped
from bench.structured_parts import part_figures
from bench.structured_sets import fresh_schema, load_data, request_sets, tools_schema
from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine
from engine.models.tiny import save_tiny_chat_model
from tokens.sampling_params import SamplingParams, StructuredOutput


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = save_tiny_chat_model(tmp_path_factory.mktemp("bench-structured") / "tiny", seed=5,
                                 max_position_embeddings=4096)
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", device="cpu", cache=CacheConfig(num_blocks=512)))


def _so(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


def test_the_real_schemas_name_their_source_and_compile(engine):
    data = load_data()
    assert data["source"]["repo"] == "https://github.com/guidance-ai/jsonschemabench"
    assert len(data["source"]["commit"]) == 40
    subsets = [e["subset"] for e in data["github"]]
    assert subsets.count("Github_medium") >= 2 and subsets.count("Github_hard") >= 2
    compiler = engine.structured.compiler.get()
    for e in data["github"]:
        jsonschema.validators.validator_for(e["schema"]).check_schema(e["schema"])
        compiler.compile(_so(e["schema"]))  # strict: every keyword enforced, none refused
    tools = tools_schema(data["glaive_tools"])
    assert [b["properties"]["name"]["const"] for b in tools["anyOf"]] == [t["name"] for t in data["glaive_tools"]]
    compiler.compile(_so(tools))


def test_request_sets():
    sets = {s.name: s for s in request_sets(quick=True)}
    assert list(sets) == ["warm", "cold", "github", "tools"]
    assert sets["cold"].fresh and sets["cold"].schemas == sets["warm"].schemas
    assert len({json.dumps(s) for s in sets["tools"].schemas}) == 1 and len(sets["tools"]) == 8
    assert len(sets["github"].head(4)) == 4


def test_a_fresh_schema_is_a_new_compile_of_the_same_grammar(engine):
    compiler = engine.structured.compiler.get()
    schema = request_sets(quick=True)[0].schemas[0]
    before = len(compiler.cache.compile_ms)
    masks = [compiler.matcher(_so(s)).compute_bitmask() for s in (schema, fresh_schema(schema, "a"),
                                                                   fresh_schema(schema, "b"), schema)]
    assert len(compiler.cache.compile_ms) - before == 3  # the plain one once, each fresh one
    assert len(set(masks)) == 1


def test_stepping_times_decode_steps_only(engine):
    twin = LLMEngine(engine.config, loaded=engine.loaded, tokenizer=engine.tokenizer)
    prompts = [engine.encode("a b c d e f g", chat=False), engine.encode("h i j", chat=False)]
    forced = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in (5, 3)]
    got = stepped([("a", engine, forced), ("b", twin, forced)], prompts)
    (ms_a, steps_a, toks_a), (ms_b, steps_b, toks_b) = got["a"], got["b"]
    assert steps_a == steps_b == 4  # 5 tokens: the prefill step samples the first, four decode steps
    assert toks_a == toks_b and [len(t) for t in toks_a] == [5, 3] and ms_a > 0 and ms_b > 0


def test_the_parts_replay_the_engines_grammar_code(engine):
    schema = request_sets(quick=True)[0].schemas[0]
    prompt = engine.encode("Reply in JSON.", chat=True)
    outs = engine.generate([prompt] * 3, SamplingParams(temperature=0.0, max_tokens=40, structured=_so(schema)))
    reqs = [(_so(schema), list(o.outputs[0].token_ids)) for o in outs]
    nonce = iter(range(100))
    us, compiles = part_figures(engine, reqs, None, 3)
    assert set(us) == {"fill", "fill_parallel", "fill_overlap", "apply", "advance"}
    assert all(v > 0 for v in us.values()) and not compiles  # warm: cached
    cold, compiles = part_figures(engine, reqs, lambda: [(_so(fresh_schema(schema, str(next(nonce)))), t)
                                                         for _, t in reqs], 3)
    assert len(compiles) == 9 and cold["fill"] > 0  # three modes, three requests, each a fresh compile
    assert not engine.structured.active
