"""`pdserve bench structured`: what constrained decoding costs, against unconstrained decoding
on the same engine, model and prompts, at batch 1 and batch 8, in absolute terms and as a
fraction of the decode step.

Every case is one request set (bench/structured_sets.py: ``warm``, ``cold``, ``github``,
``tools``) at one batch size, decoded greedily under each request's schema by two engines that
differ only in how the masks are filled (``serial``: one matcher after another before the
forward; ``overlap``: the batch at once on llguidance's pool while the forward runs, the
engine's default), and by their unconstrained twin ``plain`` for exactly as many tokens, all
over the same weights, stepped in turns (bench/structured_decode.py). Per case:

- ``decode_step_ms`` {plain, serial, overlap}: mean decode step (prefill steps left out);
  ``overhead`` {serial, overlap}: (constrained - plain) / plain over those steps, summed over
  ``--repeats`` rounds; ``identical``: both fill modes emitted the same tokens every round.
- ``us_per_token`` {fill, fill_parallel, fill_overlap, apply, advance}: each part of the mask
  work alone, in microseconds per token (bench/structured_parts.py): a fast forward pays them
  in full, a slow CPU step hides them; ``fill`` is the serial fill, ``fill_parallel`` the
  batch's on llguidance's pool, ``fill_overlap`` that on the fill's thread with no forward to
  hide behind (the difference is the thread hand-off).
- ``valid`` of ``requests``: outputs that parse and validate with ``jsonschema``;
  ``compile_ms``: the compiles the case's requests paid (every request in ``cold``: a schema
  of its own; ``us_per_token_warm``: the same tokens replayed on warm, cached grammars).

Top level, as before: ``overhead_batchN`` (the warm set, the default fill), ``valid`` /
``requests`` (the warm set), ``compile_ms_p50`` / ``_p99`` (cold compiles of every schema of
structured_cases.py that compiles, plus a json_object, a regex, a choice, a Lark grammar and a
structural tag). ``--compare-engines`` adds xgrammar against llguidance
(bench/structured_engines.py) as ``engines``.
"""
from __future__ import annotations

import argparse
import json
import statistics

from bench.structured_cases import CASES
from router.quantiles import upper_rank

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
_SETS = ("warm", "cold", "github", "tools")
_BATCH1_REQUESTS = 4  # batch 1 decodes this many requests of a set one at a time (warm: all of them)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="builtin name or local dir (with its tokenizer)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-tokens", type=int, default=192, help="most output tokens per constrained request")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every engine per case (times add up)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--sets", default=",".join(_SETS), help=f"request sets to decode, of {', '.join(_SETS)}")
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
    return save_tiny_chat_model(tmp / "tiny", seed=5, max_position_embeddings=4096)  # the github prompts


def _engines(model_dir, args) -> dict:
    """``plain``, then the constrained engines by fill mode, the default (the reference) first."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import LLMEngine
    from engine.structured.decoding import FillMode

    cfg = EngineConfig(model=str(model_dir), dtype=args.dtype, device="cpu", cache=CacheConfig(num_blocks=2048),
                       scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8))
    plain = LLMEngine(cfg)
    engines = {"plain": plain}
    for mode in (FillMode.OVERLAP, FillMode.SERIAL):
        e = LLMEngine(cfg, loaded=plain.loaded, tokenizer=plain.tokenizer)  # same weights, same code
        e.structured.fill = mode
        engines[mode.value] = e
    return engines


def _run(args, report, tmp) -> dict:
    from bench.structured_sets import request_sets
    if args.quick:
        args.repeats, args.max_tokens = 1, min(args.max_tokens, 48)
    model_dir = _model_dir(args, tmp, report)
    report.progress(f"loading {model_dir}")
    engines = _engines(model_dir, args)
    plain = engines["plain"]
    warmup = plain.encode("Reply with a JSON object.", chat=True)
    for e in engines.values():
        e.generate([warmup] * 2, _greedy(8))  # allocator, thread pools
    wanted = args.sets.split(",")
    cases: dict = {}
    for rset in request_sets(args.quick):
        if rset.name not in wanted:
            continue
        rset = rset.head(_BATCH1_REQUESTS) if args.quick and rset.name in ("github", "tools") else rset
        prompts = [plain.encode(a, chat=True) for a in rset.asks]
        for batch in (1, 8):
            report.progress(f"{rset.name} at batch {batch}")
            cases[f"{rset.name}_batch{batch}"] = _case(engines, prompts, rset, batch, args)
    report.table(["case", "req", "valid", "step ms plain", "serial", "overlap", "overhead serial", "overlap",
                  "fill us/tok", "par", "ovl", "apply", "advance", "identical"], [_row(n, c) for n, c in cases.items()])
    result: dict = {}
    for batch in (1, 8):
        warm = cases.get(f"warm_batch{batch}")
        if warm:
            result[f"overhead_batch{batch}"] = warm["overhead"]["overlap"]
    compile_ms = _compile_times(plain)
    result.update(valid=sum(c["valid"] for n, c in cases.items() if n.startswith("warm_")),
                  requests=sum(c["requests"] for n, c in cases.items() if n.startswith("warm_")),
                  compile_ms_p50=round(statistics.median(compile_ms), 3),
                  compile_ms_p99=round(upper_rank(compile_ms, 0.99, 0.0), 3),
                  compiles=len(compile_ms), engine="llguidance", fill="overlap",
                  model=str(args.model if not args.quick else "tiny"), dtype=args.dtype, repeats=args.repeats,
                  cases=cases)
    if args.compare_engines:
        result["engines"] = _compare(report, model_dir, plain.model_config.vocab_size)
    return result


def _case(engines: dict, prompts: list[list[int]], rset, batch: int, args) -> dict:
    """One request set at one batch size: end to end, then the parts alone."""
    from bench.structured_decode import constrained_params, run_group
    from bench.structured_parts import part_figures
    n = len(rset) if batch > 1 or rset.name == "warm" else min(len(rset), _BATCH1_REQUESTS)
    groups = [[i] for i in range(n)] if batch == 1 else [list(range(g, min(g + batch, n))) for g in range(0, n, 8)]
    runs = [run_group(engines, prompts, rset, g, args.max_tokens, args.repeats) for g in groups]
    ms = {k: sum(r.ms[k] for r in runs) for k in engines}
    steps = {k: sum(r.steps[k] for r in runs) for k in engines}
    reqs = [(i, out) for g, r in zip(groups, runs) for i, out in zip(g, r.outputs) if out]

    def with_specs(fresh: bool) -> list[tuple]:
        sos = [constrained_params(rset if fresh else _unfresh(rset), [i], 1)[0].structured for i, _ in reqs]
        return [(so, out) for so, (_, out) in zip(sos, reqs)]

    ref = engines[next(k for k in engines if k != "plain")]
    us, _ = part_figures(ref, with_specs(False), (lambda: with_specs(True)) if rset.fresh else None, batch)
    case = {"set": rset.name, "batch": batch, "requests": n, "valid": sum(r.valid for r in runs),
            "tokens": sum(r.tokens for r in runs), "decode_steps": steps["plain"],
            "decode_step_ms": {k: round(ms[k] / steps[k], 3) if steps[k] else None for k in engines},
            "overhead": {k: round((ms[k] - ms["plain"]) / ms["plain"], 4) if ms["plain"] else None
                         for k in engines if k != "plain"},
            "us_per_token": us, "identical": all(r.identical for r in runs)}
    compiles = [c for r in runs for c in r.compile_ms]
    if compiles:
        case["compile_ms"] = {"p50": round(statistics.median(compiles), 3),
                              "p99": round(upper_rank(compiles, 0.99, 0.0), 3), "n": len(compiles)}
    if rset.fresh:
        case["us_per_token_warm"] = part_figures(ref, with_specs(False), None, batch)[0]
    return case


def _unfresh(rset):
    from dataclasses import replace
    return replace(rset, fresh=False)


def _row(name: str, c: dict) -> list:
    step, over, us = c["decode_step_ms"], c["overhead"], c["us_per_token"]
    return [name, c["requests"], c["valid"], step["plain"], step.get("serial"), step.get("overlap"),
            over.get("serial"), over.get("overlap"), us["fill"], us["fill_parallel"], us["fill_overlap"], us["apply"], us["advance"],
            c["identical"]]


def _greedy(max_tokens: int):
    from tokens.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _compare(report, model_dir, vocab_size: int) -> list[dict]:
    from bench.structured_engines import compare
    engines = compare(str(model_dir), vocab_size)
    report.table(["engine", "covered", "ignored", "refused", "compile ms p50", "mask us b1", "apply us b1",
                  "mask us b8", "apply us b8"],
                 [[e["engine"]] + [e.get(k, e.get("error", "-")) for k in (
                     "covered", "ignored", "refused", "compile_ms_p50", "mask_us_batch1", "apply_us_batch1",
                     "mask_us_batch8", "apply_us_batch8")] for e in engines])
    return engines


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


