"""`pdserve bench verify-cost`: what verifying k + 1 tokens costs vs decoding 1, per batch size.

Random weights of SmolLM2-135M's shapes (no checkpoint needed, so the same command runs on a
fresh GPU machine), a paged KV cache with ``--context`` tokens of context per sequence, and for
each batch size B in ``--batches`` and each k in ``--ks`` one forward over B sequences of
q_len k + 1 (logits of every row, as verification needs) against the baseline q_len 1 forward
of the same B sequences. ``ratio`` = time(k + 1 rows per sequence) / time(1 row per sequence):
the price of a verification in plain decode steps, which is what speculative decoding's
adaptive controller weighs acceptance against (engine/speculative/control.py, StepCost).

On CPU the engine's measured matmul kernel plan is used (as the engine would); on CUDA the
flashinfer backend when installed (half precision), else the torch reference backend.
"""
from __future__ import annotations

import argparse
import time

from bench.plotting import figure


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--context", type=int, default=256, help="tokens of context per sequence")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per cell (median kept)")
    p.add_argument("--plot", default=None, metavar="FILE.png")


def _smollm2_shapes():
    from engine.models.config import ModelConfig

    return ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    })


def run(args: argparse.Namespace, report) -> dict:
    import torch

    from engine.attention import get_attention_backend
    from engine.attention.kv_cache import allocate_kv_cache
    from engine.attention.metadata import AttentionMetadata
    from engine.models.builtin import cache_dir
    from engine.models.cpu_linear import load_or_tune
    from engine.models.llama import LlamaForCausalLM

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    cfg = _smollm2_shapes()
    report.progress(f"building random SmolLM2-135M-shaped model on {device} ({dtype_name})")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if device.type == "cpu":
        model.set_linear_plan(load_or_tune(model.matmul_weights(), cache_dir() / "kernels", report.progress))
    block_size = 16
    max_rows = max(ks) + 1
    blocks_per_seq = -(-(args.context + max_rows) // block_size)
    kv = allocate_kv_cache(cfg, max(batches) * blocks_per_seq, block_size, dtype, device)
    backend = get_attention_backend(device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype)
    report.progress(f"attention backend: {type(backend).__name__}")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def forward_ms(b: int, q: int) -> float:
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(b)]
        seq_lens = [args.context + q] * b
        times = []
        for _ in range(args.repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            meta = AttentionMetadata.build([q] * b, seq_lens, tables, block_size, device)
            backend.begin_step(meta)
            ids = torch.randint(0, cfg.vocab_size, (b * q,), device=device)
            pos = torch.arange(args.context, args.context + q, device=device).repeat(b)
            hidden = model(ids, pos, kv, backend)  # [b * q, hidden]
            model.compute_logits(hidden)  # every row: verification reads all k + 1
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        times = sorted(times[1:])
        return times[len(times) // 2]

    rows, cells = [], []
    for b in batches:
        base = forward_ms(b, 1)
        for k in ks:
            ms = forward_ms(b, k + 1)
            cells.append({"batch": b, "k": k, "ms": round(ms, 3), "decode_ms": round(base, 3),
                          "ratio": round(ms / base, 3)})
            rows.append([b, k, round(base, 2), round(ms, 2), round(ms / base, 3)])
            report.progress(f"batch {b}, k {k}: {ms:.2f} ms vs {base:.2f} ms decode ({ms / base:.2f}x)")
    report.table(["batch", "k", "decode ms (q_len 1)", "verify ms (q_len k+1)", "ratio"], rows)
    if args.plot:
        _plot(args.plot, cells, batches, f"{device.type} {dtype_name}")
        report.progress(f"plot written to {args.plot}")
    return {"device": str(device), "dtype": dtype_name, "backend": type(backend).__name__,
            "context": args.context, "cells": cells}


def _plot(path: str, cells: list[dict], batches: list[int], label: str) -> None:
    with figure(path, figsize=(6, 4)) as (_, ax):
        for b in batches:
            pts = [c for c in cells if c["batch"] == b]
            ax.plot([c["k"] for c in pts], [c["ratio"] for c in pts], marker="o", label=f"batch {b}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("draft tokens k (query rows k + 1 per sequence)")
        ax.set_ylabel("verify time / decode time")
        ax.set_title(f"cost of verification, SmolLM2-135M shapes ({label})")
        ax.legend()
