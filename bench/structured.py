"""`pdserve bench structured`: what constrained decoding costs per token, against unconstrained
decoding on the same engine, model and prompts, at batch 1 and batch 8.

Each request asks (in the chat template) for JSON under one schema of
bench/structured_cases.py GENERATION_SCHEMAS and is decoded greedily under that schema.
Its unconstrained twin decodes the same prompt for exactly as many tokens (min_tokens =
max_tokens = the constrained length, EOS ignored), so both runs take the same steps at the same
batch sizes and differ only by the grammar: matcher advance, mask fill, mask apply.

``overhead_batchN`` = (decode time constrained - decode time unconstrained) / unconstrained,
over the decode steps (the prefill step is left out of both), summed over ``--repeats`` rounds.
The two runs are two engines over the same loaded weights, stepped in turns (A B B A), so a
load spike on a shared machine hits both. ``valid``: constrained outputs that parse and validate with ``jsonschema``,
out of ``requests``. ``compile_ms_p50`` / ``_p99``: cold compiles (a fresh cache) of every
schema of structured_cases.py that compiles, plus a json_object, a regex, a choice, a Lark
grammar and a structural tag. ``--compare-engines`` adds xgrammar against llguidance
(bench/structured_engines.py) as ``engines``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.structured_cases import CASES, GENERATION_SCHEMAS, case
from router.quantiles import upper_rank

# Bounded variants for --quick: a random-weight model never closes a free string by itself.
_QUICK_SCHEMAS = (
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["color", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                      "ok": {"type": "boolean"}},
     "required": ["code", "ok"], "additionalProperties": False},
)

_EXTRA_SPECS = (
    ("json_object", ""),
    ("regex", r"[A-Z][a-z]+ [0-9]{1,3}"),
    ("choice", json.dumps(["yes", "no", "maybe"])),
    ("grammar", 'start: expr\nexpr: NUMBER | "(" expr OP expr ")"\nOP: "+" | "-" | "*"\nNUMBER: /[0-9]+/\n'),
    ("structural_tag", json.dumps({"structures": [{"begin": "<tool_call>", "end": "</tool_call>", "schema": {
        "type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        "required": ["name", "arguments"]}}], "triggers": ["<tool_call>"], "at_least_one": False})),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="builtin name or local dir (with its tokenizer)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-tokens", type=int, default=192, help="most output tokens per constrained request")
    p.add_argument("--repeats", type=int, default=3, help="paired rounds of both runs per batch (times add up)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compare-engines", action="store_true",
                   help="also measure xgrammar against llguidance (coverage, compile, mask cost)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: a tiny random model with SmolLM2's vocabulary, bounded schemas, 1 round")


def run(args: argparse.Namespace, report) -> dict:
    import tempfile
    from pathlib import Path

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-structured-") as tmp:
        return _run(args, report, Path(tmp))


def _model_dir(args, tmp, report):
    if not args.quick:
        from engine.models.loader import resolve_source
        return resolve_source(args.model, progress=report.progress)

    from engine.models.tiny import save_tiny_chat_model
    return save_tiny_chat_model(tmp / "tiny", seed=5)


def _run(args, report, tmp) -> dict:
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import LLMEngine

    if args.quick:
        args.repeats, args.max_tokens = 1, min(args.max_tokens, 48)
    model_dir = _model_dir(args, tmp, report)
    report.progress(f"loading {model_dir}")
    cfg = EngineConfig(model=str(model_dir), dtype=args.dtype, device="cpu", cache=CacheConfig(num_blocks=1024),
                       scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8))
    eng = LLMEngine(cfg)
    twin = LLMEngine(cfg, loaded=eng.loaded, tokenizer=eng.tokenizer)  # same weights, same code
    schemas = list(_QUICK_SCHEMAS) if args.quick else [case(n).schema for n in GENERATION_SCHEMAS]
    prompts = [eng.encode(_ask(s), chat=True) for s in schemas]
    for e in (eng, twin):
        e.generate(prompts[:2], _params(None, 8))  # warm-up: allocator, thread pools
    batches = {1: [[i] for i in range(len(prompts))], 8: [list(range(min(8, len(prompts))))]}
    result: dict = {}
    valid = requests = 0
    rows = []
    for b, groups in batches.items():
        plain_ms = constrained_ms = 0.0
        tokens = 0
        for group in groups:
            ps = [prompts[i] for i in group]
            cons = [_params(schemas[i], args.max_tokens) for i in group]
            outs = eng.generate(ps, cons)  # the lengths the unconstrained twin decodes to
            for i, o in zip(group, outs):
                requests += 1
                valid += _valid(o.outputs[0].text, schemas[i])
            forced = [_forced(len(o.outputs[0].token_ids)) for o in outs]
            for _ in range(args.repeats):
                c_ms, p_ms = _paired(eng, twin, ps, cons, forced)
                constrained_ms += c_ms
                plain_ms += p_ms
                tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        overhead = (constrained_ms - plain_ms) / plain_ms if plain_ms else 0.0
        result[f"overhead_batch{b}"] = round(overhead, 4)
        rows.append([b, tokens, round(plain_ms, 1), round(constrained_ms, 1), round(overhead, 4)])
    report.table(["batch", "tokens", "decode ms (plain)", "decode ms (constrained)", "overhead"], rows)
    compile_ms = _compile_times(eng)
    result.update(valid=valid, requests=requests,
                  compile_ms_p50=round(statistics.median(compile_ms), 3),
                  compile_ms_p99=round(upper_rank(compile_ms, 0.99, 0.0), 3),
                  compiles=len(compile_ms), engine="llguidance", model=str(args.model if not args.quick else "tiny"),
                  dtype=args.dtype, repeats=args.repeats)
    if args.compare_engines:
        from bench.structured_engines import compare
        engines = compare(str(model_dir), eng.model_config.vocab_size)
        report.table(["engine", "covered", "ignored", "refused", "compile ms p50", "mask us b1", "apply us b1",
                      "mask us b8", "apply us b8"],
                     [[e["engine"]] + [e.get(k, e.get("error", "-")) for k in (
                         "covered", "ignored", "refused", "compile_ms_p50", "mask_us_batch1", "apply_us_batch1",
                         "mask_us_batch8", "apply_us_batch8")] for e in engines])
        result["engines"] = engines
    return result


def _ask(schema: dict) -> str:
    return ("Reply with only a JSON value, no prose, that matches this JSON schema, with realistic values:\n"
            + json.dumps(schema))


def _params(schema: dict | None, max_tokens: int):
    from tokens.sampling_params import SamplingParams, StructuredOutput
    so = None if schema is None else StructuredOutput("json_schema", json.dumps(schema))
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=so)


def _forced(n: int):
    from tokens.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)


def _paired(eng, twin, prompts: list[list[int]], constrained: list, forced: list) -> tuple[float, float]:
    """The constrained batch on ``eng`` and its unconstrained twin on ``twin``, stepped in
    turns (which goes first alternates, A B B A), so both see the same machine at the same
    moment: -> (ms of the constrained decode steps, ms of the twin's). Both runs take the same
    steps at the same batch sizes; the first step of each (the prefill of every prompt) is
    left out."""
    for e, params in ((eng, constrained), (twin, forced)):
        for p, sp in zip(prompts, params):
            e.add_request(prompt_token_ids=p, params=sp)
    totals = {id(eng): 0.0, id(twin): 0.0}
    step = 0
    while eng.has_unfinished_requests() or twin.has_unfinished_requests():
        for e in ((eng, twin) if step % 2 == 0 else (twin, eng)):
            if not e.has_unfinished_requests():
                continue
            t0 = time.perf_counter()
            e.step()
            if step:
                totals[id(e)] += (time.perf_counter() - t0) * 1e3
        step += 1
    return totals[id(eng)], totals[id(twin)]


def _valid(text: str, schema: dict) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _compile_times(eng) -> list[float]:
    """Cold compiles on a fresh cache with the engine's tokenizer."""
    from engine.structured.compiler import GrammarCompiler
    from tokens.grammar import GrammarCache, GrammarError
    from tokens.sampling_params import StructuredOutput
    compiler = GrammarCompiler(eng.structured.compiler.get().tokenizer, GrammarCache())
    specs = [("json_schema", json.dumps(c.schema)) for c in CASES] + list(_EXTRA_SPECS)
    for kind, spec in specs:
        try:
            compiler.compile(StructuredOutput(kind, spec))
        except GrammarError:
            pass  # a construct llguidance refuses: no compile time to report
    return compiler.cache.compile_ms


