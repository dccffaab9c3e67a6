"""`pdserve bench engine`: engine continuous batching vs transformers, on the same requests.

The same requests (mixed prompt and output lengths, fixed seed) run through three systems, same
weights, dtype and threads, one after the other in one run:

* engine: every request queued at once; continuous batching up to ``--batch`` sequences under a
  512-token step budget; each request stops at its own output length.
* transformers ``generate_batch`` (the main baseline): its own continuous batching over its paged
  KV cache (``ContinuousBatchingManager``), every request queued at once, at most ``--batch``
  requests and 512 tokens per batch, the same KV budget in bytes; each request has its own
  ``max_new_tokens``.
* transformers ``generate``: static batches of ``--batch`` requests in the same order,
  left-padded; a batch runs until its longest request is done (what static batching costs).

Every side is warmed up the same way before it is timed: the first ``--batch`` requests, cut to
64 prompt tokens and 8 output tokens, through the same entry point as the timed run
(``generate_batch``'s manager also runs its own ``warmup()``, as ``generate_batch`` does).
Throughput counts only the tokens each request asked for (EOS ignored on every side); the run
fails if the engine or ``generate_batch`` returns any other number of tokens for a request.

With baselines the engine runs twice, before and after them (A B A): the VMs this is measured
on drift by 10-20% within minutes (the same engine run took 58 to 71 s on one VM in one hour),
and a single engine run before long baselines would put that drift in the ratio. The ratios
use the mean of the two engine runs; ``*_range`` gives them against each run alone.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from bench.plotting import figure

KV_CACHE_BYTES = 1024 * 2**20
# --quick: a tiny model's tokens are so small that 1 GiB holds millions of them, and
# transformers sizes its per-step attention masks by cached tokens (about 6.7 GB for
# tiny-llama), more than it lets itself take on a VM that reports 8 GiB per NUMA node.
QUICK_KV_CACHE_BYTES = 32 * 2**20
STEP_TOKENS = 512  # engine max_num_batched_tokens = transformers max_batch_tokens
WARMUP_PROMPT, WARMUP_OUTPUT = 64, 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="builtin name, local dir, or tiny-<arch>")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--batch", type=int, default=16,
                   help="engine max_num_seqs = generate_batch max_requests_per_batch = static batch size")
    p.add_argument("--prompt-len", default="16,512", help="min,max prompt tokens")
    p.add_argument("--output-len", default="8,256", help="min,max output tokens")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baselines", default="generate_batch,generate",
                   help="comma list of baselines to run (generate_batch, generate, vllm; empty: engine only)")
    p.add_argument("--vllm-python", default=None,
                   help="vLLM's interpreter for --baselines vllm (default $PDSERVE_VLLM_PYTHON, else .venv-vllm)")
    p.add_argument("--vllm-modes", default="eager,compiled", help="vLLM modes to run: eager, compiled (its default)")
    p.add_argument("--batch1-tokens", type=int, default=128,
                   help="with vllm: tokens of the batch-1 decode run (a 16-token prompt) on both sides")
    p.add_argument("--skip-hf", action="store_true", help="engine only (same as --baselines '')")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: a tiny random model, 8 short requests, batch 4 (tests use it)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after the timed run, profile STEPS engine decode steps at full batch and print "
                        "the top operators (where a step's time goes)")
    p.add_argument("--plot", default=None, help="write a PNG comparing the systems")
    p.set_defaults(kv_cache_bytes=KV_CACHE_BYTES)  # the KV budget both continuous batchers get


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


def _apply_quick(args: argparse.Namespace) -> None:
    if args.model == "smollm2-135m":
        args.model = "tiny-llama"
    args.requests, args.batch, args.prompt_len, args.output_len = 8, 4, "8,64", "4,24"
    args.kv_cache_bytes = QUICK_KV_CACHE_BYTES


def run(args: argparse.Namespace, report) -> dict:
    import torch

    from bench.bench_models import bench_model_dir

    if args.quick:
        _apply_quick(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    baselines = [] if args.skip_hf else [b.strip() for b in args.baselines.split(",") if b.strip()]
    unknown = set(baselines) - {"generate_batch", "generate", "vllm"}
    if unknown:
        raise SystemExit(f"unknown baseline(s) {sorted(unknown)}; choose from generate_batch, generate, vllm")
    if "vllm" in baselines:
        from bench.vllm_baseline import parse_modes
        from node.vllm_engine import vllm_python

        args.vllm_modes_list = parse_modes(args.vllm_modes)
        try:
            args.vllm_python = vllm_python(args.vllm_python)
        except FileNotFoundError as e:
            raise SystemExit(f"--baselines vllm: {e}") from None
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-engine-") as tmp:
        model_dir = bench_model_dir(args.model, Path(tmp), progress=report.progress)
        return _run(args, report, model_dir, baselines)


def _run(args, report, model_dir: Path, baselines: list[str]) -> dict:
    import torch

    from engine.device import torch_dtype

    threads = args.threads_used = torch.get_num_threads()
    args.step_tokens = STEP_TOKENS
    prange = tuple(int(x) for x in args.prompt_len.split(","))
    orange = tuple(int(x) for x in args.output_len.split(","))
    import transformers

    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    reqs = make_requests(args.requests, prange, orange, vocab, args.seed)
    warm = [(p[:WARMUP_PROMPT], WARMUP_OUTPUT) for p, _ in reqs[: args.batch]]
    useful = sum(o for _, o in reqs)

    eng = _load_engine(model_dir, warm, args, report)
    runs = [_time_engine(eng, reqs, report)]
    eng_info = {"engine_steps": runs[0][1], "engine_preemptions": eng.scheduler.num_preemptions}
    if args.profile:
        eng_info["profile"] = _profile_decode(eng, reqs, args, report)
    result = {"requests": len(reqs), "output_tokens": useful, "batch": args.batch, "dtype": args.dtype,
              "threads": threads, "model": args.model, **eng_info}
    baseline_s = {}
    if {"generate_batch", "generate"} & set(baselines):
        report.progress(f"loading transformers reference ({args.dtype})")
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(args.dtype)).eval()
    if "generate_batch" in baselines:
        baseline_s["generate_batch"] = _run_generate_batch(hf, reqs, warm, args, report)
    if "generate" in baselines:
        baseline_s["hf"] = _run_static(hf, reqs, warm, args, report)
    if "vllm" in baselines:
        from bench.vllm_baseline import run_vllm_side

        vllm_s, vllm_info = run_vllm_side(args.vllm_python, model_dir, args.vllm_modes_list, reqs, warm, eng, args,
                                          report)
        baseline_s.update(vllm_s)
        result.update(vllm_info)
    if baselines:
        report.progress("engine again, after the baselines (drift check)")
        runs.append(_time_engine(eng, reqs, report))
    engine_runs = [t for t, _ in runs]
    t_eng = sum(engine_runs) / len(engine_runs)
    engine_tok_s = useful / t_eng
    result.update(engine_tok_s=engine_tok_s, engine_s=t_eng, engine_s_runs=[round(t, 3) for t in engine_runs])
    rows = [[f"pdserve engine (continuous; mean of {len(runs)} runs)" if len(runs) > 1 else
             "pdserve engine (continuous)", t_eng, engine_tok_s]]
    for name, ratio, label in (
        ("generate_batch", "speedup_vs_generate_batch", "transformers generate_batch (continuous, paged)"),
        ("hf", "speedup_vs_hf", "transformers generate (static batches)"),
        ("vllm_eager", "speedup_vs_vllm_eager", "vLLM CPU (enforce_eager)"),
        ("vllm_compiled", "speedup_vs_vllm_compiled", "vLLM CPU (compiled, its default)"),
    ):
        if name not in baseline_s:
            continue
        t = baseline_s[name]
        result.update({f"{name}_tok_s": useful / t, f"{name}_s": t, ratio: t / t_eng,
                       f"{ratio}_range": [round(t / max(engine_runs), 3), round(t / min(engine_runs), 3)]})
        rows.append([label, t, useful / t])
    vllm_runs = [baseline_s[k] for k in ("vllm_eager", "vllm_compiled") if k in baseline_s]
    if vllm_runs:  # against vLLM at its best: the faster of its modes
        best = min(vllm_runs)
        result.update(speedup_vs_vllm=best / t_eng,
                      speedup_vs_vllm_range=[round(best / max(engine_runs), 3), round(best / min(engine_runs), 3)])
    report.table(["system", "seconds", "useful tok/s"], rows)
    if args.plot:
        _plot(args.plot, rows, args)
    return result


def _load_engine(model_dir, warm, args, report):
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import LLMEngine
    from tokens.sampling_params import SamplingParams

    report.progress(f"loading engine ({args.dtype})")
    eng = LLMEngine(EngineConfig(
        model=str(model_dir), dtype=args.dtype, device="cpu",
        cache=CacheConfig(kv_cache_bytes=args.kv_cache_bytes, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=STEP_TOKENS, max_num_seqs=args.batch),
    ), load_tokenizer=False)
    eng.generate([p for p, _ in warm], [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)
                                        for _, o in warm])
    return eng


def _time_engine(eng, reqs, report) -> tuple[float, int]:
    """Every request queued at once, stepped to the end -> (seconds, steps)."""
    from tokens.sampling_params import SamplingParams

    steps0, preempted0 = eng.num_steps, eng.scheduler.num_preemptions
    report.progress(f"engine: {len(reqs)} requests, {sum(o for _, o in reqs)} output tokens")
    t0 = time.perf_counter()
    ids = [eng.add_request(prompt_token_ids=p, params=SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
           for p, o in reqs]
    got: dict[str, int] = {}
    last = t0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = len(out.outputs[0].token_ids)
        if time.perf_counter() - last > 10:
            last = time.perf_counter()
            report.progress(f"engine: {len(got)}/{len(reqs)} done ({last - t0:.0f}s)")
    t_eng = time.perf_counter() - t0
    _check_lengths("engine", [got.get(i, 0) for i in ids], reqs)
    steps = eng.num_steps - steps0
    report.progress(f"engine: {t_eng:.1f}s, {steps} steps, "
                    f"{eng.scheduler.num_preemptions - preempted0} preemptions")
    return t_eng, steps


def _profile_decode(eng, reqs, args, report) -> list[dict]:
    """Where a full-batch decode step's time goes: ``--batch`` requests prefilled, then
    ``--profile`` decode steps under torch's profiler; the top operators by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    from tokens.sampling_params import SamplingParams

    for p, _ in reqs[: args.batch]:
        eng.add_request(prompt_token_ids=p, params=SamplingParams(temperature=0.0, max_tokens=args.profile + 64,
                                                                   ignore_eos=True))
    while eng.scheduler.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                           for s in eng.scheduler.running):
        eng.step()
    for _ in range(3):
        eng.step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile):
            eng.step()
    step_ms = (time.perf_counter() - t0) / args.profile * 1e3
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) or 1.0
    out = [{"op": e.key, "share": e.self_cpu_time_total / total, "calls_per_step": e.count / args.profile,
            "ms_per_step": e.self_cpu_time_total / 1e3 / args.profile} for e in rows]
    report.progress(f"profile: {args.batch} sequences, {step_ms:.1f} ms per decode step (under the profiler)")
    report.table(["operator", "share", "calls/step", "ms/step"],
                 [[o["op"], round(o["share"], 3), o["calls_per_step"], round(o["ms_per_step"], 2)] for o in out])
    while eng.has_unfinished_requests():
        eng.step()
    return out


def _run_generate_batch(hf, reqs, warm, args, report) -> float:
    """transformers' continuous batching, driven through its manager so that each request gets
    its own ``max_new_tokens`` (``generate_batch`` itself takes one for all)."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    per_token = 2 * hf.config.num_hidden_layers * hf.config.num_key_value_heads * _head_dim(hf.config)
    per_token *= torch.tensor([], dtype=hf.dtype).element_size()
    page = 256  # transformers' default page size
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=max(1, args.kv_cache_bytes // (per_token * page)),
                                  max_batch_tokens=STEP_TOKENS, max_requests_per_batch=args.batch)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)

    def wave(mgr, batch, tag) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        ids = [mgr.add_request(p, request_id=f"{tag}{i}", max_new_tokens=o, eos_token_id=-1)
               for i, (p, o) in enumerate(batch)]
        done: dict[str, int] = {}
        while len(done) < len(ids):
            r = mgr.get_result(timeout=1)
            if r is not None and r.is_finished():
                if r.error is not None:
                    raise RuntimeError(f"generate_batch request {r.request_id} failed: {r.error}")
                done[r.request_id] = len(r.generated_tokens)
            elif r is None and not mgr.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
        return time.perf_counter() - t0, [done[i] for i in ids]

    report.progress("transformers generate_batch: warm-up")
    with torch.inference_mode():
        mgr = hf.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        mgr.warmup()
        mgr.start()
        try:
            wave(mgr, warm, "warm")
            report.progress(f"transformers generate_batch: {len(reqs)} requests")
            t, lengths = wave(mgr, reqs, "r")
        finally:
            mgr.stop(block=True, timeout=30)
            mgr.destroy()
    _check_lengths("generate_batch", lengths, reqs)
    report.progress(f"transformers generate_batch: {t:.1f}s")
    return t


def _run_static(hf, reqs, warm, args, report) -> float:
    import torch

    def batches(rs):
        with torch.inference_mode():
            for b in range(0, len(rs), args.batch):
                batch = rs[b:b + args.batch]
                width = max(len(p) for p, _ in batch)
                ids = torch.zeros((len(batch), width), dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for i, (p, _) in enumerate(batch):
                    ids[i, width - len(p):] = torch.tensor(p)
                    mask[i, width - len(p):] = 1
                longest = max(o for _, o in batch)
                hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                            do_sample=False, pad_token_id=0)
                yield b // args.batch + 1

    report.progress("transformers generate: warm-up")
    for _ in batches(warm):
        pass
    t0 = time.perf_counter()
    n = (len(reqs) + args.batch - 1) // args.batch
    for i in batches(reqs):
        report.progress(f"transformers generate: batch {i}/{n} done ({time.perf_counter() - t0:.0f}s)")
    return time.perf_counter() - t0


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _check_lengths(system: str, got: list[int], reqs) -> None:
    bad = [(i, n, o) for i, (n, (_, o)) in enumerate(zip(got, reqs)) if n != o]
    if bad:
        i, n, o = bad[0]
        raise RuntimeError(f"{system} produced the wrong number of tokens for {len(bad)} request(s), "
                           f"e.g. request {i}: {n} instead of {o}; its throughput would not be comparable")


def _plot(path: str, rows, args) -> None:
    labels = [r[0].replace(" (", "\n(") for r in rows]
    with figure(path, dpi=120, figsize=(6, 3.5)) as (_, ax):
        ax.bar(labels, [r[2] for r in rows], color=["#2a7", "#57a", "#888", "#c63", "#a4c"][: len(rows)])
        ax.set_ylabel("useful output tokens / s")
        ax.set_title(f"{args.model}, {args.dtype}, batch {args.batch}, {args.requests} requests")
        ax.tick_params(axis="x", labelsize=7)
