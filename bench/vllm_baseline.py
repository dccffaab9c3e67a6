"""vLLM as `pdserve bench engine`'s peer (``--baselines vllm``): the driver side.

vLLM runs in its own environment (bench/vllm_peer.py under ``--vllm-python``, by default the one
``make vllm`` builds), once per mode (``eager``, ``compiled``: vLLM's default), on the engine's
requests as token ids, each with its own ``max_tokens``, EOS ignored, the same batch and step
budget, prefix caching off, the same KV bytes. Threads are pinned the same way: vLLM on CPU
reserves one core for itself by default and binds its OpenMP threads to the rest, so on two
cores it would compute on one; here it gets the engine's thread count on the first cores the
bench may use (``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``).

A peer that computes garbage fast must not win: output lengths are checked on both sides, and
a few real prompts are decoded greedily by both, the ids compared. In float32 they must be
identical; in bfloat16 the two sum in different orders, so a divergence at a near tie is
expected and only reported.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

PEER = Path(__file__).with_name("vllm_peer.py")
MODES = ("eager", "compiled")
CHECK_PROMPTS = ("The capital of France is", "def fibonacci(n):",
                 "List three colors of the rainbow:", "Water boils at a temperature of")
CHECK_TOKENS = 24
PEER_TIMEOUT_S = 1800.0


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = sorted(set(modes) - set(MODES))
    if bad or not modes:
        raise SystemExit(f"--vllm-modes takes {', '.join(MODES)} (comma list), got {text!r}")
    return modes


def thread_env(threads: int, kv_cache_bytes: int, cores: list[int] | None = None) -> dict[str, str]:
    """The environment that gives vLLM ``threads`` OpenMP threads on the first usable cores and
    the KV budget in GiB (its unit; at least 1)."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))[:threads]
    return {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_cache_bytes / 2**30))), "VLLM_LOGGING_LEVEL": "WARNING"}


def check_prompt_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p)["input_ids"] for p in CHECK_PROMPTS]


def run_peer(python: str, model_dir: Path, spec: dict, threads: int, kv_cache_bytes: int, report) -> dict:
    """One vLLM run (bench/vllm_peer.py) -> its JSON output."""
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-vllm-") as tmp:
        src, dst = Path(tmp, "in.json"), Path(tmp, "out.json")
        src.write_text(json.dumps({"model": str(model_dir), **spec}))
        env = {**os.environ, **thread_env(threads, kv_cache_bytes)}
        env.pop("PYTHONPATH", None)  # vLLM's environment, not the project's
        report.progress(f"vLLM {spec['mode']}: starting ({python}); its load and warm-up are not timed")
        try:
            proc = subprocess.run([python, str(PEER), str(src), str(dst)], env=env, capture_output=True, text=True,
                                  timeout=PEER_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"vLLM {spec['mode']} did not finish in {PEER_TIMEOUT_S:.0f} s") from e
        if proc.returncode != 0 or not dst.exists():
            raise RuntimeError(f"vLLM {spec['mode']} failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
        out = json.loads(dst.read_text())
    report.progress(f"vLLM {spec['mode']}: {out['seconds']:.1f}s")
    return out


def compare_greedy(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Per check prompt: identical or the first position where the two greedy decodes part."""
    first = []
    for a, b in zip(ours, theirs):
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        first.append(diff if diff is not None or len(a) == len(b) else min(len(a), len(b)))
    return {"identical": sum(d is None for d in first), "prompts": len(first), "first_divergence": first}


def run_vllm_side(python: str, model_dir: Path, modes: list[str], reqs, warm, eng, args, report) -> tuple[dict, dict]:
    """Every vLLM mode on the bench's requests -> ({"vllm_<mode>": seconds}, result fields: the
    greedy comparison, batch-1 tokens/s of both sides, vLLM's load times)."""
    import time

    from bench.engine_throughput import _check_lengths as check_lengths
    from tokens.sampling_params import SamplingParams

    checks = check_prompt_ids(model_dir)
    greedy = SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids) for o in eng.generate(checks, [greedy] * len(checks))]
    b1_prompt = reqs[0][0][:16]
    eng.generate([b1_prompt], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)])
    t0 = time.perf_counter()
    eng.generate([b1_prompt], [SamplingParams(temperature=0.0, max_tokens=args.batch1_tokens, ignore_eos=True)])
    batch1 = {"engine": round(args.batch1_tokens / (time.perf_counter() - t0), 2)}
    spec = {"dtype": args.dtype, "batch": args.batch, "step_tokens": args.step_tokens,
            "max_model_len": max(len(p) + o for p, o in [*reqs, *((c, CHECK_TOKENS) for c in checks)]) + 16,
            "requests": reqs, "warm": warm, "check": [(c, CHECK_TOKENS) for c in checks],
            "batch1": (b1_prompt, args.batch1_tokens)}
    seconds, extra = {}, {"vllm_load_s": {}, "greedy_check": {}}
    for mode in modes:
        out = run_peer(python, model_dir, {**spec, "mode": mode}, args.threads_used, args.kv_cache_bytes, report)
        check_lengths(f"vLLM {mode}", out["lengths"], reqs)
        seconds[f"vllm_{mode}"] = out["seconds"]
        extra["vllm_load_s"][mode] = round(out["load_s"], 1)
        extra["greedy_check"][mode] = compare_greedy(ours, out["check_ids"])
        batch1[f"vllm_{mode}"] = round(out["batch1_tokens"] / out["batch1_s"], 2)
    extra["batch1_decode_tokens_per_s"] = batch1
    best = max(v for k, v in batch1.items() if k != "engine")
    extra["batch1_speedup_vs_vllm"] = round(batch1["engine"] / best, 3)
    # float32 sums in the same precision on both sides: greedy ids must agree; bfloat16 may part at a near tie.
    extra["greedy_identical_required"] = args.dtype == "float32"
    extra["greedy_ok"] = all(g["identical"] == g["prompts"] for g in extra["greedy_check"].values()) \
        or args.dtype != "float32"
    return seconds, extra
