"""`pdserve bench specdec`: speculative decoding vs plain decoding, side by side in one run.

One target model (SmolLM2-135M by default) is loaded once and shared by every engine: a
baseline engine without speculation and one engine per proposer. Each engine runs two prompt
sets with greedy decoding and exactly ``--max-tokens`` output tokens per prompt:

* grounded: 16 prompts that summarise, extract from or edit a text or code given in the prompt
  (the setting where the output copies the input and n-gram lookup shines);
* open: open-ended questions (the control set: little to copy, speculation must not slow it).

``speedup`` is the ratio of output tokens/s (spec / baseline) on the grounded set and
``speedup_open`` on the open set, both for the first proposer in ``--proposers``;
``outputs_identical`` checks every proposer's greedy token ids against the baseline's.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

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
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--proposers", default="ngram,early_exit,low_precision",
                   help="comma list of speculative methods; the first gives the headline figures")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt (exact)")
    p.add_argument("--num-grounded", type=int, default=len(GROUNDED))
    p.add_argument("--num-open", type=int, default=len(OPEN))
    p.add_argument("--batch", type=int, default=1,
                   help="requests in flight at once (1 = one request at a time, the latency regime)")
    p.add_argument("--spec-tokens", type=int, default=12,
                   help="most draft tokens per sequence and step (the controller trims each draft)")
    p.add_argument("--early-exit-layers", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="target dtype for every engine of the run (the baseline too)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="bar chart of tokens/s per engine")


def run(args: argparse.Namespace, report) -> dict:
    import torch

    from decode_node.spec import build_proposer
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from engine.engine import LLMEngine, encode_chat, load_hf_tokenizer, torch_dtype
    from engine.models.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    report.progress(f"loading {args.model}")
    loaded = load_model(args.model, torch_dtype(args.dtype), "cpu", progress=report.progress)
    tok = load_hf_tokenizer(loaded.tokenizer_path)
    sets = {
        "grounded": [encode_chat(tok, [{"role": "user", "content": p}]) for p in GROUNDED[: args.num_grounded]],
        "open": [encode_chat(tok, [{"role": "user", "content": p}]) for p in OPEN[: args.num_open]],
    }
    base_cfg = EngineConfig(model=args.model, dtype=args.dtype, device="cpu",
                            cache=CacheConfig(num_blocks=1024),
                            scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max(1, args.batch)))

    def engine(method: str) -> LLMEngine:
        spec = SpeculativeConfig(method=method, num_speculative_tokens=args.spec_tokens,
                                 early_exit_layers=args.early_exit_layers)
        cfg = dataclasses.replace(base_cfg, speculative=spec)
        return LLMEngine(cfg, loaded=loaded, tokenizer=tok, proposer_factory=build_proposer)

    from tokens.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
    methods = ["off"] + [m.strip() for m in args.proposers.split(",") if m.strip()]
    engines = {m: engine(m) for m in methods}
    # Warm up every engine (allocator, thread pools, RoPE tables) outside the timed runs.
    for eng in engines.values():
        eng.generate([sets["grounded"][0], sets["open"][0]], SamplingParams(temperature=0.0, max_tokens=8))
    results: dict[str, dict] = {m: {} for m in methods}
    outputs: dict[str, dict] = {m: {} for m in methods}
    for set_name, prompts in sets.items():
        # Interleave engines per chunk of prompts, so slow drift of the machine hits all alike.
        for i in range(0, len(prompts), max(1, args.batch)):
            chunk = prompts[i : i + max(1, args.batch)]
            for m, eng in engines.items():
                before = eng.spec.stats.as_dict() if eng.spec is not None else None
                t0 = time.perf_counter()
                outs = eng.generate(chunk, params)
                dt = time.perf_counter() - t0
                r = results[m].setdefault(set_name, {"seconds": 0.0, "tokens": 0})
                r["seconds"] += dt
                r["tokens"] += sum(len(o.outputs[0].token_ids) for o in outs)
                outputs[m].setdefault(set_name, []).extend(o.outputs[0].token_ids for o in outs)
                if before is not None:
                    after = eng.spec.stats.as_dict()
                    r["drafts"] = r.get("drafts", 0) + after["drafts"] - before["drafts"]
                    r["accepted"] = r.get("accepted", 0) + after["accepted_tokens"] - before["accepted_tokens"]
            report.progress(f"{set_name}: {min(i + len(chunk), len(prompts))}/{len(prompts)} prompts")

    rows, per = [], {}
    for m in methods:
        entry = {}
        for set_name in sets:
            r = results[m][set_name]
            tps = r["tokens"] / r["seconds"]
            base_tps = results["off"][set_name]["tokens"] / results["off"][set_name]["seconds"]
            # Tokens per verification forward: accepted drafts plus the one the target adds.
            mean_acc = 1.0 + r["accepted"] / r["drafts"] if r.get("drafts") else 1.0
            entry[set_name] = {"tok_s": tps, "speedup": tps / base_tps, "mean_accepted_tokens": mean_acc,
                               "identical": outputs[m][set_name] == outputs["off"][set_name]}
            rows.append([m, set_name, round(tps, 2), round(tps / base_tps, 3), round(mean_acc, 3),
                         entry[set_name]["identical"]])
        per[m] = entry
    report.table(["proposer", "set", "tok/s", "speedup", "mean accepted tokens", "identical"], rows)
    if args.plot:
        _plot(args.plot, per, list(sets))
        report.progress(f"plot written to {args.plot}")
    head = per[methods[1]] if len(methods) > 1 else per["off"]
    return {
        "speedup": head["grounded"]["speedup"],
        "speedup_open": head["open"]["speedup"],
        "mean_accepted_tokens": head["grounded"]["mean_accepted_tokens"],
        "outputs_identical": all(e[s]["identical"] for e in per.values() for s in sets),
        "proposer": methods[1] if len(methods) > 1 else "off",
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "per_proposer": per,
    }


def _plot(path: str, per: dict, set_names: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(per)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(set_names)
    for j, s in enumerate(set_names):
        ax.bar([i + j * width for i in range(len(methods))], [per[m][s]["tok_s"] for m in methods], width, label=s)
    ax.set_xticks([i + width * (len(set_names) - 1) / 2 for i in range(len(methods))], methods)
    ax.set_ylabel("output tokens/s")
    ax.set_title("speculative decoding vs plain decoding (greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
