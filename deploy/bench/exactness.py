"""`pdserve bench exactness`: greedy token ids of the engine vs transformers `generate`.

Same weights, same dtype. The engine runs every prompt set as one continuous batch (mixed
lengths, chunked prefill under a small token budget), then a second wave that shares a long
system prompt with the first (prefix-cache hits). transformers runs each prompt alone at
batch 1, the reference. Raw logits at every generated position are compared too: the engine's
come from its model runner, the reference's from one teacher-forced forward over
prompt + engine output.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one paragraph.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning, my friend' into Spanish.",
    "What does a CPU cache do?",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Write a Python function that reverses a string.",
    "What is 17 times 23?",
    "Name four planets of the solar system.",
    "Describe a cat to someone who has never seen one, in great detail, covering its fur, "
    "eyes, tail, sounds, habits and why people keep them as pets.",
    "hi",
    "Explain the difference between TCP and UDP for a networking beginner.",
    "What are the health benefits of walking every day?",
]
SYSTEM = (
    "You are a concise assistant for a company that builds distributed systems. Answer in plain "
    "English, avoid jargon unless asked, and keep answers short. If you do not know, say so."
)
SHARED_PREFIX_PROMPTS = [
    "What is a load balancer?",
    "What is a message queue?",
    "What is eventual consistency?",
    "Why do databases use write-ahead logs?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="smollm2-135m,tiny-llama,tiny-qwen2",
                   help="comma list: builtin names, local dirs, or tiny-<arch> random models")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)


def run(args: argparse.Namespace, report) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    cases = []
    with tempfile.TemporaryDirectory(prefix="pdserve-exact-") as tmp:
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            cases.append(_run_model(name, Path(tmp), args, report))
    report.table(
        ["model", "prompts", "identical", "cached tokens (2nd wave)", "max |logit diff|"],
        [[c["model"], c["prompts"], c["identical"], c["cached_tokens"], c["max_logit_abs_diff"]] for c in cases],
    )
    return {
        "prompts": sum(c["prompts"] for c in cases),
        "identical": sum(c["identical"] for c in cases),
        "max_logit_abs_diff": max(c["max_logit_abs_diff"] for c in cases),
        "dtype": args.dtype,
        "per_model": cases,
    }


def _run_model(name: str, tmp: Path, args, report) -> dict:
    import random

    import torch
    import transformers

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import LLMEngine, encode_chat, torch_dtype
    from engine.models.loader import resolve_source
    from engine.models.tiny import save_tiny_model
    from tokens.sampling_params import SamplingParams

    dtype = torch_dtype(args.dtype)
    tiny = name.startswith("tiny-")
    if tiny:
        model_dir = save_tiny_model(tmp / name, arch=name.removeprefix("tiny-"), seed=0)
    else:
        model_dir = resolve_source(name, progress=report.progress)
    report.progress(f"{name}: loading engine and reference ({args.dtype})")
    cfg = EngineConfig(
        model=str(model_dir), dtype=args.dtype, device="cpu",
        cache=CacheConfig(block_size=16, num_blocks=2048),
        # A small budget forces chunked prefill and mixes prefill chunks with decodes.
        scheduler=SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=16),
    )
    eng = LLMEngine(cfg, load_tokenizer=not tiny)
    captured: dict[str, list[torch.Tensor]] = {}

    def hook(seq_ids, logits):
        for sid, row in zip(seq_ids, logits):
            captured.setdefault(sid, []).append(row.float().clone())

    eng.runner.logits_hook = hook
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    if tiny:
        rng = random.Random(1)
        vocab = eng.model_config.vocab_size
        shared = [rng.randrange(3, vocab) for _ in range(40)]
        wave1 = [[rng.randrange(3, vocab) for _ in range(rng.choice([1, 5, 17, 33, 64, 130]))] for _ in range(12)]
        wave2 = [shared + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
        wave1 += [shared + [rng.randrange(3, vocab) for _ in range(7)]]
        # Random weights: EOS is just another token, so run to max_tokens on both sides.
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
    else:
        tok = eng.tokenizer
        wave1 = [encode_chat(tok, [{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
        wave1 += [encode_chat(tok, [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": SHARED_PREFIX_PROMPTS[0]}])]
        wave2 = [encode_chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}])
                 for p in SHARED_PREFIX_PROMPTS[1:]] + [wave1[0], wave1[2]]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    report.progress(f"{name}: engine, wave 1 ({len(wave1)} prompts, one continuous batch)")
    outs1 = eng.generate(wave1, params)
    report.progress(f"{name}: engine, wave 2 ({len(wave2)} prompts sharing cached prefixes)")
    outs2 = eng.generate(wave2, params)
    cached = sum(o.num_cached_tokens for o in outs2)

    identical = 0
    max_diff = 0.0
    eos = list(eng.eos_token_ids)
    for i, (prompt, out) in enumerate(zip(wave1 + wave2, outs1 + outs2)):
        got = out.outputs[0].token_ids
        ids = torch.tensor([prompt])
        gen_kwargs = dict(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=eos,
                          attention_mask=torch.ones_like(ids), pad_token_id=eos[0] if eos else 0)
        if tiny:
            gen_kwargs["min_new_tokens"] = args.max_tokens
        with torch.inference_mode():
            ref = hf.generate(ids, **gen_kwargs)[0, len(prompt):].tolist()
            full = torch.tensor([prompt + got[:-1]])
            ref_logits = hf(full).logits[0, len(prompt) - 1:].float()  # [len(got), V]
        if ref == got:
            identical += 1
        else:
            report.progress(f"{name}: prompt {i} differs: engine {got[:12]}... vs hf {ref[:12]}...")
        eng_logits = torch.stack(captured[f"{out.request_id}#0"])  # [len(got), V]
        max_diff = max(max_diff, float((eng_logits - ref_logits).abs().max()))
    report.progress(f"{name}: {identical}/{len(wave1) + len(wave2)} identical, "
                    f"max |logit diff| {max_diff:.3g}, cached tokens in wave 2: {cached}")
    return {"model": name, "prompts": len(wave1) + len(wave2), "identical": identical,
            "max_logit_abs_diff": max_diff, "cached_tokens": cached}
