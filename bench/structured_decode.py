"""End to end for `pdserve bench structured`: one group of requests decoded by engines over the
same weights, stepped in turns, so a load spike on a shared machine hits all of them alike.

``plain`` decodes the prompts unconstrained for exactly as many tokens as the constrained run
emitted (min_tokens = max_tokens, EOS ignored), so every engine takes the same steps at the same
batch sizes; the constrained engines (``serial``, ``overlap``: how their masks are filled,
engine/structured/decoding.py FillMode) differ from it only by the grammar. Only decode steps
are timed: a step that prefilled (``last_step_prefill_tokens``) is left out of every engine,
and the engines schedule alike, so they leave out the same steps.
"""
from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field

from bench.structured_sets import RequestSet, fresh_schema

_NONCES = itertools.count()


@dataclass
class GroupRun:
    """One group over every round: per engine the decode ms and steps; the constrained
    reference outputs (tokens, validity), and whether the fill modes emitted the same."""

    outputs: list[list[int]] = field(default_factory=list)  # the reference run's token ids, per request
    valid: int = 0
    tokens: int = 0  # constrained tokens over every round
    ms: dict[str, float] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    identical: bool = True
    compile_ms: list[float] = field(default_factory=list)  # the compiles the group's requests paid


def constrained_params(rset: RequestSet, group: list[int], max_tokens: int) -> list:
    """Greedy params under each request's schema; a fresh set's under a schema never used."""
    from tokens.sampling_params import SamplingParams, StructuredOutput
    out = []
    for i in group:
        schema = fresh_schema(rset.schemas[i], str(next(_NONCES))) if rset.fresh else rset.schemas[i]
        out.append(SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                  structured=StructuredOutput("json_schema", json.dumps(schema))))
    return out


def _forced(n: int):
    from tokens.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)


def run_group(engines: dict, prompts: list[list[int]], rset: RequestSet, group: list[int], max_tokens: int,
              repeats: int) -> GroupRun:
    """``engines``: ``plain``, then the constrained ones by fill mode (the first is the
    reference: its outputs are validated and fix the plain run's lengths)."""
    run = GroupRun()
    ps = [prompts[i] for i in group]
    ref_name = next(n for n in engines if n != "plain")
    ref = engines[ref_name]
    before = len(_compiles(ref))
    outs = ref.generate(ps, constrained_params(rset, group, max_tokens))
    run.compile_ms += _compiles(ref)[before:]  # a schema's first use, or every fresh one
    run.outputs = [list(o.outputs[0].token_ids) for o in outs]
    run.valid = sum(valid_json(o.outputs[0].text, rset.schemas[i]) for i, o in zip(group, outs))
    forced = [_forced(len(t)) for t in run.outputs]
    for _ in range(repeats):
        compiled = {n: len(_compiles(e)) for n, e in engines.items() if n != "plain"}
        runs = [(n, e, forced if n == "plain" else constrained_params(rset, group, max_tokens))
                for n, e in engines.items()]
        got = stepped(runs, ps)
        emitted = {n: toks for n, (_, _, toks) in got.items() if n != "plain"}
        run.identical &= all(t == emitted[ref_name] for t in emitted.values())
        for n, (ms, steps, _) in got.items():
            run.ms[n] = run.ms.get(n, 0.0) + ms
            run.steps[n] = run.steps.get(n, 0) + steps
        run.tokens += sum(len(t) for t in emitted[ref_name])
        if rset.fresh:
            run.compile_ms += [ms for n, e in engines.items() if n != "plain" for ms in _compiles(e)[compiled[n]:]]
    return run


def stepped(runs: list[tuple], prompts: list[list[int]]) -> dict[str, tuple[float, int, list[list[int]]]]:
    """``runs``: (name, engine, params per prompt). Every engine gets the prompts, then they
    step in turns, the one that goes first rotating each step -> per name (ms of its decode
    steps, how many, each request's emitted token ids)."""
    rids = {name: [e.add_request(prompt_token_ids=p, params=sp) for p, sp in zip(prompts, params)]
            for name, e, params in runs}
    totals = {name: 0.0 for name, _, _ in runs}
    steps = dict.fromkeys(totals, 0)
    emitted: dict[tuple[str, str], list[int]] = {}  # (engine, request id): request ids are per engine
    for k in itertools.count():
        live = [(name, e) for name, e, _ in runs if e.has_unfinished_requests()]
        if not live:
            break
        for name, e in live[k % len(live):] + live[:k % len(live)]:
            t0 = time.perf_counter()
            outs = e.step()
            dt = (time.perf_counter() - t0) * 1e3
            if e.last_step_prefill_tokens == 0:
                totals[name] += dt
                steps[name] += 1
            for o in outs:
                if o.finished:
                    emitted[name, o.request_id] = list(o.outputs[0].token_ids)
    return {name: (totals[name], steps[name], [emitted.get((name, r), []) for r in rids[name]]) for name, _, _ in runs}


def _compiles(eng) -> list[float]:
    return eng.structured.compiler.get().cache.compile_ms


def valid_json(text: str, schema: dict) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False
