"""Self-drafting with a lower-precision copy of the target (bfloat16 by default): same weights
rounded, its own paged KV in that dtype. On CPUs with bf16 matmuls it drafts faster than the
float32 target and agrees with it on most greedy tokens."""
from __future__ import annotations

from decode_node.spec.draft_model import own_kv_drafter
from engine.engine import torch_dtype
from engine.models.loader import load_model

# The controller's prior for a bf16 draft round relative to a float32 step, until it has timed
# one (docs/benchmarks.md, "Figures behind constants").
BF16_DRAFT_COST = 0.6


def from_engine(engine):
    cfg = engine.config.speculative
    if cfg.draft_dtype == engine.config.dtype:
        raise ValueError(f"low_precision drafting needs a draft_dtype other than the target's ({cfg.draft_dtype})")
    loaded = load_model(engine.config.model, torch_dtype(cfg.draft_dtype), engine.device)
    return own_kv_drafter(engine, loaded, cfg.draft_dtype, BF16_DRAFT_COST)
