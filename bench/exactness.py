"""`pdserve bench exactness`: greedy token ids of the engine vs transformers `generate`.

Same weights, same dtype, ``--max-tokens`` (128) output tokens. The engine runs every prompt set
as one continuous batch (mixed lengths, chunked prefill under a small token budget), then a
second wave of new prompts that share cached prefixes with the first (a system prompt, an earlier
chat turn). Every prompt is distinct. transformers runs each prompt alone at batch 1, the
reference: continuous batching, chunking and prefix caching must not change a greedy token.

Each dtype in ``--dtypes`` runs the whole comparison. float32 must be identical. In bfloat16
a position's result depends on the shape of the call that computed it: SDPA's CPU kernel rounds
a query row differently (by one bf16 ulp in a fraction of a percent of elements) when it runs as
a 1-row decode than as a row of a causal prefill, and the engine computes a position as a decode
row in a padded batch, in a prefill chunk, or after a prefix-cache hit where transformers'
``generate`` ran one prefill and 1-row decodes. So a greedy choice between two near-equal logits
can flip. For each prompt that differs the run reports the first divergence position, the top-2
logit gap there on both sides (the reference's also in bf16 ulps at that magnitude), which token
transformers itself picks when it computes that position in one prefill call (the teacher-forced
forward: ``hf_prefill_token``), and whether the engine alone (the prompt by itself, no chunking,
nothing cached: transformers' call shapes) matches ``generate``. A divergence is a near tie when
the reference's gap between its token and the engine's is at most ``NEAR_TIE_ULPS`` bf16 ulps.

Raw logits at every generated position are compared too: the engine's come from its model
runner, the reference's from one teacher-forced forward over prompt + engine output.
"""
from __future__ import annotations

import argparse
import math
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
# Second turns of two first-wave chats: new prompts whose first blocks are already cached.
FOLLOW_UPS = [
    (0, "The capital of France is Paris.", "And what is the capital of Italy?"),
    (2, "A hash table maps keys to values through a hash function.", "How does it handle collisions?"),
]
NEAR_TIE_ULPS = 2.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="smollm2-135m,tiny-llama,tiny-qwen2",
                   help="comma list: builtin names, local dirs, or tiny-<arch> random models")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="comma list; the first gives the top-level figures, bfloat16 the 'bf16' block")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="one dtype only (same as --dtypes DTYPE)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="run the engine over N ranks (engine/parallel/; CPU processes); N must divide the "
                        "model's heads: the default models become smollm2-135m (9 and 3 heads: N = 3)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: one tiny random model, 16 output tokens (tests use it)")


def run(args: argparse.Namespace, report) -> dict:
    import torch

    if args.quick:
        if args.models == "smollm2-135m,tiny-llama,tiny-qwen2":
            args.models = "tiny-llama"
        args.max_tokens = min(args.max_tokens, 16)
    if args.tensor_parallel > 1 and args.models == "smollm2-135m,tiny-llama,tiny-qwen2":
        args.models = "smollm2-135m"  # the tiny models' 4 heads split by 2 or 4 only
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [args.dtype] if args.dtype else [d.strip() for d in args.dtypes.split(",") if d.strip()]
    by_dtype: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-exact-") as tmp:
        for dtype in dtypes:
            by_dtype[dtype] = [_run_model(name, Path(tmp), dtype, args, report)
                               for name in [m.strip() for m in args.models.split(",") if m.strip()]]
    report.table(
        ["dtype", "model", "prompts", "identical", "cached tokens (2nd wave)", "max |logit diff|"],
        [[d, c["model"], c["prompts"], c["identical"], c["cached_tokens"], c["max_logit_abs_diff"]]
         for d, cases in by_dtype.items() for c in cases],
    )
    divs = [dv for cases in by_dtype.values() for c in cases for dv in c["divergences"]]
    if divs:
        report.table(
            ["dtype", "model", "prompt", "position", "ref / engine token", "ref gap (ulps)", "engine gap",
             "hf one-call token", "near tie", "engine alone identical"],
            [[dv["dtype"], dv["model"], dv["prompt"], dv["position"], f"{dv['ref_token']} / {dv['engine_token']}",
              f"{dv['ref_gap']:.4g} ({dv['ref_gap_ulps']:.2g})", dv["engine_gap"], dv["hf_prefill_token"],
              dv["near_tie"], dv["engine_alone_identical"]] for dv in divs],
        )
    head = by_dtype[dtypes[0]]
    result = {**_summary(head), "max_tokens": args.max_tokens, "dtype": dtypes[0], "per_model": head,
              "tensor_parallel": args.tensor_parallel}
    if "bfloat16" in by_dtype:
        result["bf16"] = _summary(by_dtype["bfloat16"]) | {"per_model": by_dtype["bfloat16"]}
    return result


def _summary(cases: list[dict]) -> dict:
    divs = [dv for c in cases for dv in c["divergences"]]
    return {
        "prompts": sum(c["prompts"] for c in cases),
        "identical": sum(c["identical"] for c in cases),
        "near_tie_divergences": sum(dv["near_tie"] for dv in divs),
        # transformers' own one-call forward picks the engine's token at the divergence
        "hf_prefill_agrees_with_engine": sum(dv["hf_prefill_token"] == dv["engine_token"] for dv in divs
                                             if dv["engine_token"] is not None),
        "divergences": len(divs),
        "first_divergence_positions": [dv["position"] for dv in divs],
        "max_logit_abs_diff": max(c["max_logit_abs_diff"] for c in cases),
    }


def bf16_ulp(x: float) -> float:
    """Spacing of bfloat16 numbers at magnitude |x| (8 significant bits)."""
    x = abs(x)
    return 2.0 ** (math.floor(math.log2(x)) - 7) if x > 0 else 2.0**-133


def _prompts(name: str, eng, tiny: bool) -> tuple[list[list[int]], list[list[int]]]:
    import random

    from engine.tokenizer import encode_chat

    if tiny:
        rng = random.Random(1)
        vocab = eng.model_config.vocab_size
        shared = [rng.randrange(3, vocab) for _ in range(40)]
        wave1 = [[rng.randrange(3, vocab) for _ in range(rng.choice([1, 5, 17, 33, 64, 130]))] for _ in range(12)]
        wave2 = [shared + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
        wave1 += [shared + [rng.randrange(3, vocab) for _ in range(7)]]
    else:
        tok = eng.tokenizer
        wave1 = [encode_chat(tok, [{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
        wave1 += [encode_chat(tok, [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": SHARED_PREFIX_PROMPTS[0]}])]
        wave2 = [encode_chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}])
                 for p in SHARED_PREFIX_PROMPTS[1:]]
        wave2 += [encode_chat(tok, [{"role": "user", "content": CHAT_PROMPTS[i]},
                                    {"role": "assistant", "content": answer},
                                    {"role": "user", "content": follow}]) for i, answer, follow in FOLLOW_UPS]
    distinct = {tuple(p) for p in wave1 + wave2}
    if len(distinct) != len(wave1) + len(wave2):
        raise RuntimeError(f"{name}: the exactness prompts must be distinct")
    return wave1, wave2


def _run_model(name: str, tmp: Path, dtype_name: str, args, report) -> dict:
    from bench.bench_models import bench_model_dir
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.device import torch_dtype
    from engine.engine import LLMEngine

    dtype = torch_dtype(dtype_name)
    tiny = name.startswith("tiny-")
    model_dir = tmp / name if tiny and (tmp / name).exists() else bench_model_dir(name, tmp, report.progress)
    report.progress(f"{name}: loading engine and reference ({dtype_name})")

    closers = []

    def new_engine(alone: bool = False) -> LLMEngine:
        cfg = EngineConfig(
            model=str(model_dir), dtype=dtype_name, device="cpu",
            cache=CacheConfig(block_size=16, num_blocks=2048, enable_prefix_caching=not alone),
            # A small budget forces chunked prefill and mixes prefill chunks with decodes; alone,
            # a prompt is one prefill and then 1-row decodes, as in transformers' generate.
            scheduler=SchedulerConfig(max_num_batched_tokens=4096 if alone else 96, max_num_seqs=16),
        )
        if args.tensor_parallel == 1:
            return LLMEngine(cfg, load_tokenizer=not tiny)
        from engine.parallel.executor import start_tp_engine
        from engine.parallel.plan import TensorParallelConfig

        tp = start_tp_engine(cfg, TensorParallelConfig(size=args.tensor_parallel), load_tokenizer=not tiny)
        closers.append(tp.close)
        return tp.engine

    try:
        return _compare(name, new_engine, model_dir, dtype, dtype_name, tiny, args, report)
    finally:
        for close in closers:
            close()


def _compare(name: str, new_engine, model_dir, dtype, dtype_name: str, tiny: bool, args, report) -> dict:
    import torch
    import transformers

    from tokens.sampling_params import SamplingParams

    eng = new_engine()
    captured: dict[str, list[torch.Tensor]] = {}

    def hook(seq_ids, logits):
        for sid, row in zip(seq_ids, logits):
            captured.setdefault(sid, []).append(row.float().clone())

    eng.runner.logits_hook = hook
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    wave1, wave2 = _prompts(name, eng, tiny)
    # Random weights: EOS is just another token, so run to max_tokens on both sides.
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            min_tokens=args.max_tokens if tiny else 0)

    report.progress(f"{name}: engine, wave 1 ({len(wave1)} prompts, one continuous batch)")
    outs1 = eng.generate(wave1, params)
    report.progress(f"{name}: engine, wave 2 ({len(wave2)} new prompts sharing cached prefixes)")
    outs2 = eng.generate(wave2, params)
    cached = sum(o.num_cached_tokens for o in outs2)

    identical = 0
    max_diff = 0.0
    divergences = []
    eos = list(eng.eos_token_ids)
    alone = None
    for i, (prompt, out) in enumerate(zip(wave1 + wave2, outs1 + outs2)):
        got = out.outputs[0].token_ids
        ids = torch.tensor([prompt])
        gen_kwargs = dict(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=eos,
                          attention_mask=torch.ones_like(ids), pad_token_id=eos[0] if eos else 0,
                          output_logits=True, return_dict_in_generate=True)
        if tiny:
            gen_kwargs["min_new_tokens"] = args.max_tokens
        with torch.inference_mode():
            gen = hf.generate(ids, **gen_kwargs)
            ref = gen.sequences[0, len(prompt):].tolist()
            full = torch.tensor([prompt + got[:-1]])
            ref_logits = hf(full).logits[0, len(prompt) - 1:].float()  # [len(got), V]
        eng_logits = torch.stack(captured[f"{out.request_id}#0"])  # [len(got), V]
        max_diff = max(max_diff, float((eng_logits - ref_logits).abs().max()))
        if ref == got:
            identical += 1
            continue
        pos = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        if alone is None:
            alone = new_engine(alone=True)
        alone_got = alone.generate([prompt], params)[0].outputs[0].token_ids
        dv = {"dtype": dtype_name, "model": name, "prompt": i, "position": pos,
              "engine_alone_identical": alone_got == ref}
        if pos < min(len(ref), len(got)):
            r_row = gen.logits[pos][0].float()  # what generate chose from at this step
            e_row = eng_logits[pos]
            rt, et = ref[pos], got[pos]
            ref_gap = float(r_row[rt] - r_row[et])
            dv.update(ref_token=rt, engine_token=et, ref_gap=ref_gap,
                      engine_gap=float(e_row[et] - e_row[rt]),
                      # ref_logits[pos] is transformers on the same context, computed in one call.
                      hf_prefill_token=int(ref_logits[pos].argmax()),
                      ref_gap_ulps=ref_gap / bf16_ulp(float(r_row[rt])),
                      near_tie=ref_gap <= NEAR_TIE_ULPS * bf16_ulp(float(r_row[rt])))
        else:  # one side stopped (EOS) where the other went on: not a choice between two tokens
            dv.update(ref_token=None, engine_token=None, ref_gap=float("nan"), engine_gap=float("nan"),
                      hf_prefill_token=None, ref_gap_ulps=float("nan"), near_tie=False)
        divergences.append(dv)
        report.progress(f"{name} ({dtype_name}): prompt {i} differs at output position {pos}: engine "
                        f"{got[pos:pos + 4]} vs hf {ref[pos:pos + 4]}, reference top-2 gap {dv['ref_gap']:.4g}; "
                        f"transformers in one prefill call picks {dv['hf_prefill_token']}; "
                        f"engine alone {'matches' if dv['engine_alone_identical'] else 'differs too'}")
    n = len(wave1) + len(wave2)
    report.progress(f"{name} ({dtype_name}): {identical}/{n} identical, max |logit diff| {max_diff:.3g}, "
                    f"cached tokens in wave 2: {cached}")
    return {"model": name, "prompts": n, "identical": identical, "max_logit_abs_diff": max_diff,
            "cached_tokens": cached, "divergences": divergences}
