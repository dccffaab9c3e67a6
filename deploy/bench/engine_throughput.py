"""`pdserve bench engine`: engine continuous batching vs transformers `generate` static batches.

The same requests (mixed prompt and output lengths, fixed seed) run through both, same
weights, dtype and threads, side by side in one run:

* engine: every request queued at once; continuous batching up to ``--batch`` sequences;
  each request stops at its own output length.
* transformers: static batches of ``--batch`` requests in the same order, left-padded; a
  batch runs until its longest request is done (that is what static batching costs).

Throughput counts only the tokens each request asked for (EOS ignored on both sides).
"""
from __future__ import annotations

import argparse
import random
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="engine max_num_seqs = HF static batch size")
    p.add_argument("--prompt-len", default="16,512", help="min,max prompt tokens")
    p.add_argument("--output-len", default="8,256", help="min,max output tokens")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="engine only (no ratio)")
    p.add_argument("--plot", default=None, help="write a PNG comparing the two")


def make_requests(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        olen = rng.randint(*output_range)
        # Avoid the lowest ids (special tokens in most vocabularies).
        reqs.append(([rng.randrange(100, vocab) for _ in range(plen)], olen))
    return reqs


def run(args: argparse.Namespace, report) -> dict:
    import torch
    import transformers

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import LLMEngine, torch_dtype
    from engine.models.loader import resolve_source
    from tokens.sampling_params import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    model_dir = resolve_source(args.model, progress=report.progress)
    prange = tuple(int(x) for x in args.prompt_len.split(","))
    orange = tuple(int(x) for x in args.output_len.split(","))

    report.progress(f"loading engine ({args.dtype}, {threads} threads)")
    eng = LLMEngine(EngineConfig(
        model=str(model_dir), dtype=args.dtype, device="cpu",
        cache=CacheConfig(kv_cache_bytes=1024 * 2**20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=args.batch),
    ), load_tokenizer=False)
    reqs = make_requests(args.requests, prange, orange, eng.model_config.vocab_size, args.seed)
    useful = sum(o for _, o in reqs)

    # Warm-up: first calls pay for allocator growth and kernel selection.
    eng.generate([reqs[0][0][:32]], SamplingParams(temperature=0.0, max_tokens=4))

    report.progress(f"engine: {len(reqs)} requests, {useful} output tokens")
    t0 = time.perf_counter()
    for prompt, olen in reqs:
        eng.add_request(prompt_token_ids=prompt,
                        params=SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True))
    done = 0
    produced = 0
    last = t0
    while eng.has_unfinished_requests():
        for out in eng.step():
            produced += sum(len(c.new_token_ids) for c in out.outputs)
            done += out.finished
        if time.perf_counter() - last > 10:
            last = time.perf_counter()
            report.progress(f"engine: {done}/{len(reqs)} done, {produced} tokens, "
                            f"{produced / (last - t0):.1f} tok/s")
    t_eng = time.perf_counter() - t0
    engine_tok_s = useful / t_eng
    report.progress(f"engine: {t_eng:.1f}s, {engine_tok_s:.1f} tok/s, {eng.num_steps} steps, "
                    f"{eng.scheduler.num_preemptions} preemptions")
    del eng

    result = {"engine_tok_s": engine_tok_s, "engine_s": t_eng, "requests": len(reqs),
              "output_tokens": useful, "batch": args.batch, "dtype": args.dtype, "threads": threads}
    if args.skip_hf:
        return result

    report.progress("loading transformers reference")
    dtype = torch_dtype(args.dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(reqs), args.batch):
            batch = reqs[b:b + args.batch]
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, (p, _) in enumerate(batch):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            longest = max(o for _, o in batch)
            hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                        do_sample=False, pad_token_id=pad)
            report.progress(f"transformers: batch {b // args.batch + 1}/"
                            f"{(len(reqs) + args.batch - 1) // args.batch} done "
                            f"({time.perf_counter() - t0:.0f}s)")
    t_hf = time.perf_counter() - t0
    hf_tok_s = useful / t_hf
    result.update(hf_tok_s=hf_tok_s, hf_s=t_hf, speedup_vs_hf=engine_tok_s / hf_tok_s)
    report.table(["system", "seconds", "useful tok/s"],
                 [["pdserve engine (continuous)", t_eng, engine_tok_s],
                  ["transformers generate (static)", t_hf, hf_tok_s]])
    if args.plot:
        _plot(args.plot, engine_tok_s, hf_tok_s, args)
    return result


def _plot(path: str, eng: float, hf: float, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(["pdserve engine\n(continuous)", "transformers\n(static batches)"], [eng, hf], color=["#2a7", "#888"])
    ax.set_ylabel("useful output tokens / s")
    ax.set_title(f"{args.model}, {args.dtype}, batch {args.batch}, {args.requests} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
