"""`pdserve bench specdec`: speculative decoding vs plain decoding, side by side in one run.

One target model (SmolLM2-135M by default) is loaded once and shared by every engine: a
baseline engine without speculation and one engine per proposer. Each engine runs two prompt
sets with greedy decoding:

* grounded: 16 prompts that summarise, extract from or edit a text or code given in the prompt
  (the setting where the output copies the input and n-gram lookup shines);
* open: open-ended questions (the control set: little to copy, speculation must not slow it).

Headline (natural stopping): each request ends at EOS or ``--max-tokens``, as a user's would.
``speedup`` is the ratio of output tokens/s (spec / baseline) on the grounded set and
``speedup_open`` on the open set, both for the first proposer in ``--proposers``. Every engine
produces the same tokens (checked: ``outputs_identical``), so the ratio is a ratio of times.

Second row (forced length, the method before issue 15): exactly ``--max-tokens`` tokens per
prompt (``min_tokens`` masks EOS). Past its natural end a small model repeats itself, which
flatters n-gram drafts; kept as ``speedup_forced_length`` for comparison (baseline and first
proposer only).

Peer row (batch 1): transformers' prompt lookup decoding (``generate(prompt_lookup_num_tokens=
N)``, the same n-gram idea) against transformers' plain greedy ``generate``, same prompts, same
stopping, in the same interleaved loop: ``hf_prompt_lookup_speedup``. transformers' assisted
generation runs one sequence at a time, so with ``--batch`` > 1 the peer row is left out.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

from bench.plotting import figure

_CODE_A = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, email = line.strip().split(",")
            users.append({"name": name, "age": int(age), "email": email})
    return users


def adults(users):
    return [u for u in users if u["age"] >= 18]
'''
_CODE_B = '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]
'''
_CODE_C = '''function total(cart) {
  let sum = 0;
  for (const item of cart.items) {
    sum += item.price * item.quantity;
  }
  if (cart.coupon) {
    sum = sum * (1 - cart.coupon.discount);
  }
  return Math.round(sum * 100) / 100;
}
'''
_TEXT_A = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. "
           "Council member Rivera said the lanes had reduced traffic accidents by twenty percent "
           "since March. Shop owners complained that parking spaces were lost and deliveries were "
           "slower. The council agreed to add ten loading zones and to review the lanes again in "
           "six months.")
_TEXT_B = ("Order #4471 was placed by Maria Lopez on 12 May 2024. It contains two blue ceramic mugs "
           "at 8.50 euros each, one teapot at 24.00 euros and a set of six spoons at 12.00 euros. "
           "Shipping to Calle Mayor 15, Madrid costs 5.90 euros. The customer asked for gift "
           "wrapping and delivery before 20 May.")
_TEXT_C = ("Photosynthesis is the process by which green plants use sunlight to make food. Inside "
           "the leaves, chlorophyll absorbs light energy. The plant takes in carbon dioxide from the "
           "air and water from the soil, and turns them into glucose and oxygen. The glucose feeds "
           "the plant, and the oxygen is released into the air, which animals need to breathe.")

GROUNDED = [
    f"Add type hints and a docstring to every function in this code, and return the full code:\n\n{_CODE_A}",
    f"Rename the variable `users` to `people` everywhere in this code and return the full code:\n\n{_CODE_A}",
    f"Add a method `size` that returns the number of items to this class. Return the whole class:\n\n{_CODE_B}",
    f"Add a docstring to every method of this class and return the whole class:\n\n{_CODE_B}",
    f"Rewrite this JavaScript function in Python, keeping the same logic and names:\n\n{_CODE_C}",
    f"Add a comment above every line of this function explaining it, and return the code:\n\n{_CODE_C}",
    f"Fix the indentation and add error handling for a missing file to this code:\n\n{_CODE_A}",
    f"Convert this class to use a collections.deque instead of a list. Return the full code:\n\n{_CODE_B}",
    f"Summarize this news article in three sentences:\n\n{_TEXT_A}",
    f"List every fact in this article as a bullet point, quoting the article:\n\n{_TEXT_A}",
    f"Extract the customer name, date, items, prices and address from this order as JSON:\n\n{_TEXT_B}",
    f"Rewrite this order description as a table with one row per item:\n\n{_TEXT_B}",
    f"Summarize this paragraph for a ten-year-old, reusing its words:\n\n{_TEXT_C}",
    f"Copy this paragraph and underline (with *stars*) every noun:\n\n{_TEXT_C}",
    f"Rewrite this article in the past perfect tense, sentence by sentence:\n\n{_TEXT_A}",
    f"Correct any grammar mistakes in this text and return the corrected text:\n\n{_TEXT_C}",
]
OPEN = [
    "Write a short story about a robot who learns to paint.",
    "What are some good habits for staying healthy?",
    "Explain why the ocean is salty.",
    "Describe your ideal weekend trip.",
    "Give me ideas for a birthday party for a six-year-old.",
    "Why do people enjoy music?",
    "Write a poem about winter mornings.",
    "What would happen if the moon disappeared?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="builtin name, local dir, or tiny-<arch>")
    p.add_argument("--proposers", default="ngram,early_exit,low_precision",
                   help="comma list of speculative methods; the first gives the headline figures")
    p.add_argument("--max-tokens", type=int, default=128, help="most output tokens per prompt")
    p.add_argument("--num-grounded", type=int, default=len(GROUNDED))
    p.add_argument("--num-open", type=int, default=len(OPEN))
    p.add_argument("--batch", type=int, default=1,
                   help="requests in flight at once (1 = one request at a time, the latency regime)")
    p.add_argument("--spec-tokens", type=int, default=12,
                   help="most draft tokens per sequence and step (the controller trims each draft)")
    p.add_argument("--early-exit-layers", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="target dtype for every engine of the run (the baseline too)")
    p.add_argument("--hf-prompt-lookup-tokens", type=int, default=10,
                   help="transformers' prompt_lookup_num_tokens for the peer row (its documented default)")
    p.add_argument("--skip-hf", action="store_true", help="leave out the transformers peer row")
    p.add_argument("--skip-forced", action="store_true", help="leave out the forced-length row")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every chunk of prompts this many times per engine, the engine order reversed "
                        "on every other repeat (A B B A); times add up, `speedup_repeats` gives each repeat's "
                        "ratio. A batch-8 chunk is one 8-11 s batch, which this VM alone moves by +-13%%")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: a tiny random model, 2 + 2 token-id prompts, 16 tokens, n-gram (tests use it)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="bar chart of tokens/s per engine")


def _apply_quick(args: argparse.Namespace) -> None:
    if args.model == "smollm2-135m":
        args.model = "tiny-llama"
    if args.proposers == "ngram,early_exit,low_precision":
        args.proposers = "ngram"
    args.max_tokens = min(args.max_tokens, 16)
    args.num_grounded, args.num_open = min(args.num_grounded, 2), min(args.num_open, 2)


def _token_sets(vocab: int, args) -> dict[str, list[list[int]]]:
    """Prompts for a model without a tokenizer: grounded ones repeat a segment (something to copy)."""
    import random

    rng = random.Random(0)
    grounded = []
    for _ in range(args.num_grounded):
        seg = [rng.randrange(3, vocab) for _ in range(12)]
        grounded.append(seg * 4 + [rng.randrange(3, vocab) for _ in range(4)] + seg[:4])
    opened = [[rng.randrange(3, vocab) for _ in range(24)] for _ in range(args.num_open)]
    return {"grounded": grounded, "open": opened}


def run(args: argparse.Namespace, report) -> dict:
    import tempfile
    from pathlib import Path

    import torch

    if args.quick:
        _apply_quick(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-specdec-") as tmp:
        return _run(args, report, Path(tmp))


def _run(args: argparse.Namespace, report, tmp) -> dict:
    from bench.bench_models import bench_model_dir
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from engine.device import torch_dtype
    from engine.engine import LLMEngine
    from engine.models.loader import load_model
    from engine.speculative.proposers import build_proposer
    from engine.tokenizer import encode_chat, load_hf_tokenizer
    from tokens.sampling_params import SamplingParams

    args.repeats = max(1, args.repeats)
    tiny = args.model.startswith("tiny-")
    model_dir = bench_model_dir(args.model, tmp, progress=report.progress)
    model_name = str(model_dir) if tiny else args.model
    report.progress(f"loading {args.model}")
    loaded = load_model(model_name, torch_dtype(args.dtype), "cpu", progress=report.progress)
    tok = None if tiny else load_hf_tokenizer(loaded.tokenizer_path)
    if tok is None:
        sets = _token_sets(loaded.config.vocab_size, args)
    else:
        sets = {
            "grounded": [encode_chat(tok, [{"role": "user", "content": p}]) for p in GROUNDED[: args.num_grounded]],
            "open": [encode_chat(tok, [{"role": "user", "content": p}]) for p in OPEN[: args.num_open]],
        }
    batch = max(1, args.batch)
    base_cfg = EngineConfig(model=model_name, dtype=args.dtype, device="cpu",
                            cache=CacheConfig(num_blocks=1024),
                            scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=batch))

    def engine(method: str) -> LLMEngine:
        spec = SpeculativeConfig(method=method, num_speculative_tokens=args.spec_tokens,
                                 early_exit_layers=args.early_exit_layers)
        cfg = dataclasses.replace(base_cfg, speculative=spec)
        return LLMEngine(cfg, loaded=loaded, tokenizer=tok, load_tokenizer=False, proposer_factory=build_proposer)

    methods = ["off"] + [m.strip() for m in args.proposers.split(",") if m.strip()]
    engines = {m: engine(m) for m in methods}
    eos = list(engines["off"].eos_token_ids)
    hf = None
    if not args.skip_hf and batch == 1:
        import transformers

        report.progress("loading the transformers peer")
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(args.dtype)).eval()
    warm = [sets["grounded"][0], sets["open"][0]]
    # Warm up every engine and the peer (allocator, thread pools, RoPE tables) outside the timed runs.
    for eng in engines.values():
        eng.generate(warm, SamplingParams(temperature=0.0, max_tokens=8))
    if hf is not None:
        for p in warm:
            for lookup in (None, args.hf_prompt_lookup_tokens):
                _hf_generate(hf, p, 8, eos, lookup, forced=False)

    natural = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    per, outputs = _measure(engines, sets, natural, batch, hf, eos, args, report, "natural")
    forced_per = None
    if not args.skip_forced:
        forced = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
        forced_per, forced_out = _measure({m: engines[m] for m in methods[:2]}, sets, forced, batch, None, eos,
                                          args, report, "forced length")
    rows = []
    for mode, table in (("natural", per), ("forced length", forced_per)):
        for m, entry in (table or {}).items():
            for set_name, e in entry.items():
                rows.append([mode, m, set_name, e["tokens"], round(e["tok_s"], 2), round(e["speedup"], 3),
                             round(e["mean_accepted_tokens"], 3), e["identical"]])
    report.table(["stopping", "proposer", "set", "tokens", "tok/s", "speedup", "mean accepted tokens",
                  "identical"], rows)
    if args.plot:
        _plot(args.plot, {m: e for m, e in per.items() if not m.startswith("hf_")}, list(sets))
        report.progress(f"plot written to {args.plot}")
    head_name = methods[1] if len(methods) > 1 else "off"
    head = per[head_name]
    engine_methods = [m for m in per if not m.startswith("hf_")]
    result = {
        "speedup": head["grounded"]["speedup"],
        "speedup_open": head["open"]["speedup"],
        "mean_accepted_tokens": head["grounded"]["mean_accepted_tokens"],
        "outputs_identical": all(per[m][s]["identical"] for m in engine_methods for s in sets)
        and (forced_per is None or all(e[s]["identical"] for e in forced_per.values() for s in sets)),
        "stopping": "natural (EOS or max_tokens)",
        "mean_output_tokens": {s: per["off"][s]["tokens"] / max(1, len(sets[s]) * args.repeats) for s in sets},
        "proposer": head_name,
        "batch": args.batch,
        "repeats": args.repeats,
        "speedup_repeats": head["grounded"].get("speedup_repeats"),
        "speedup_open_repeats": head["open"].get("speedup_repeats"),
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "per_proposer": {m: per[m] for m in engine_methods},
    }
    if forced_per is not None:
        result.update(speedup_forced_length=forced_per[head_name]["grounded"]["speedup"],
                      speedup_open_forced_length=forced_per[head_name]["open"]["speedup"],
                      per_proposer_forced_length=forced_per)
    if hf is not None:
        pl = per["hf_prompt_lookup"]
        result.update(
            hf_prompt_lookup_speedup=pl["grounded"]["speedup"],
            hf_prompt_lookup_speedup_open=pl["open"]["speedup"],
            hf_prompt_lookup_tokens=args.hf_prompt_lookup_tokens,
            hf_outputs_identical=all(pl[s]["identical"] for s in sets),
            # Greedy transformers vs the engine's baseline: the same tokens when both are exact.
            hf_matches_engine=sum(a == b for s in sets for a, b in zip(outputs["hf_generate"][s], outputs["off"][s])),
            hf_per_set={m: per[m] for m in ("hf_generate", "hf_prompt_lookup")},
        )
    else:
        result["hf_prompt_lookup_speedup"] = None
        result["hf_note"] = ("left out: --skip-hf" if args.skip_hf else
                             "left out: transformers' prompt lookup runs one sequence at a time (--batch 1)")
    return result


def _hf_generate(hf, prompt: list[int], max_tokens: int, eos: list[int], lookup: int | None, forced: bool) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else 0,
                  attention_mask=torch.ones_like(ids))
    if forced:
        kwargs["min_new_tokens"] = max_tokens
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    with torch.inference_mode():
        out = hf.generate(ids, **kwargs)[0, len(prompt):].tolist()
    # transformers pads nothing at batch 1, but keep only the tokens up to and including EOS.
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1]
    return out


def _measure(engines: dict, sets: dict, params, batch: int, hf, eos, args, report, label: str):
    """Run every prompt set through every engine (and the peer pair), interleaved per chunk of
    prompts so slow drift of the machine hits them alike. -> (per system per set figures,
    per system per set token ids)."""
    results: dict[str, dict] = {}
    outputs: dict[str, dict] = {}
    forced = params.min_tokens > 0
    repeats = args.repeats
    for set_name, prompts in sets.items():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            for rep in range(repeats):
                order = list(engines.items()) if rep % 2 == 0 else list(engines.items())[::-1]
                for m, eng in order:
                    before = eng.spec.stats.as_dict() if eng.spec is not None else None
                    t0 = time.perf_counter()
                    outs = eng.generate(chunk, params)
                    dt = time.perf_counter() - t0
                    ids = [o.outputs[0].token_ids for o in outs]
                    n = sum(len(t) for t in ids)
                    r = results.setdefault(m, {}).setdefault(set_name, {"seconds": 0.0, "tokens": 0})
                    r["seconds"] += dt
                    r["tokens"] += n
                    r.setdefault("rep_seconds", [0.0] * repeats)[rep] += dt
                    r.setdefault("rep_tokens", [0] * repeats)[rep] += n
                    if rep == 0:
                        outputs.setdefault(m, {}).setdefault(set_name, []).extend(ids)
                    elif ids != outputs[m][set_name][-len(ids):]:
                        raise RuntimeError(f"{m} returned other tokens on repeat {rep + 1} of the same prompts")
                    if before is not None:
                        after = eng.spec.stats.as_dict()
                        r["drafts"] = r.get("drafts", 0) + after["drafts"] - before["drafts"]
                        r["accepted"] = r.get("accepted", 0) + after["accepted_tokens"] - before["accepted_tokens"]
            if hf is not None:
                for name, lookup in (("hf_generate", None), ("hf_prompt_lookup", args.hf_prompt_lookup_tokens)):
                    t0 = time.perf_counter()
                    toks = [_hf_generate(hf, p, args.max_tokens, eos, lookup, forced) for p in chunk]
                    r = results.setdefault(name, {}).setdefault(set_name, {"seconds": 0.0, "tokens": 0})
                    r["seconds"] += time.perf_counter() - t0
                    r["tokens"] += sum(len(t) for t in toks)
                    outputs.setdefault(name, {}).setdefault(set_name, []).extend(toks)
            report.progress(f"{label}, {set_name}: {min(i + len(chunk), len(prompts))}/{len(prompts)} prompts")

    per: dict[str, dict] = {}
    for m, by_set in results.items():
        base = "hf_generate" if m.startswith("hf_") else "off"
        for set_name, r in by_set.items():
            tps = r["tokens"] / r["seconds"]
            b = results[base][set_name]
            # Tokens per verification forward: accepted drafts plus the one the target adds.
            mean_acc = 1.0 + r["accepted"] / r["drafts"] if r.get("drafts") else 1.0
            per.setdefault(m, {})[set_name] = {
                "tok_s": tps, "tokens": r["tokens"], "seconds": r["seconds"],
                "speedup": tps / (b["tokens"] / b["seconds"]), "mean_accepted_tokens": mean_acc,
                "identical": outputs[m][set_name] == outputs[base][set_name]}
            if "rep_seconds" in r and "rep_seconds" in b:  # the engines; the peer pair runs once
                per[m][set_name]["speedup_repeats"] = [
                    round((t / s) / (bt / bs), 4)
                    for t, s, bt, bs in zip(r["rep_tokens"], r["rep_seconds"], b["rep_tokens"], b["rep_seconds"])]
    return per, outputs


def _plot(path: str, per: dict, set_names: list[str]) -> None:
    methods = list(per)
    width = 0.8 / len(set_names)
    with figure(path, figsize=(7, 4)) as (_, ax):
        for j, s in enumerate(set_names):
            ax.bar([i + j * width for i in range(len(methods))], [per[m][s]["tok_s"] for m in methods], width, label=s)
        ax.set_xticks([i + width * (len(set_names) - 1) / 2 for i in range(len(methods))], methods)
        ax.set_ylabel("output tokens/s")
        ax.set_title("speculative decoding vs plain decoding (greedy)")
        ax.legend()
