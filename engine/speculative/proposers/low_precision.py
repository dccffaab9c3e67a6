"""Self-drafting with a lower-precision copy of the target (bfloat16 by default): same weights
rounded, its own paged KV in that dtype. On CPUs with bf16 matmuls it drafts faster than the
float32 target and agrees with it on most greedy tokens. On CPUs without them (AVX2 only) torch
emulates bf16 matmuls and a draft round costs more than a target step: no acceptance rate can
pay for that, so the proposer measures it and declines (the node decodes without speculation;
with ``adaptive`` off it drafts as told)."""
from __future__ import annotations

import logging

from engine.device import torch_dtype
from engine.models.builtin import cache_dir
from engine.models.cpu_linear import load_or_tune
from engine.models.loader import load_model
from engine.speculative.proposers.draft_model import own_kv_drafter

log = logging.getLogger(__name__)

# The controller's prior for a bf16 draft round relative to a float32 step, until it has timed
# one (docs/benchmarks.md, "Figures behind constants"); used off CPU, where no plan is measured.
BF16_DRAFT_COST = 0.6
# A draft round must cost less than this many target steps for drafting to be built at all.
# With draft cost c, k drafts of which a are accepted, and a verification costing v >= 1 step,
# a step yields (a + 1) / (k c + v) tokens per step-time against 1 without drafting: c >= 1
# loses at any acceptance, and at a typical 70% acceptance (a = 0.7 k, v ~ 1.1) c must stay
# below about 0.7. 0.9 leaves the region in between to the controller, which measures.
MAX_DRAFT_COST = 0.9


def from_engine(engine):
    cfg = engine.config.speculative
    if cfg.draft_dtype == engine.config.dtype:
        raise ValueError(f"low_precision drafting needs a draft_dtype other than the target's ({cfg.draft_dtype})")
    loaded = load_model(engine.config.model, torch_dtype(cfg.draft_dtype), engine.device)
    draft_cost = BF16_DRAFT_COST
    if engine.linear_plan is not None:  # CPU: both sides' matmul kernels measured on this machine
        plan = load_or_tune(loaded.model.matmul_weights(), cache_dir() / "kernels")
        loaded.model.set_linear_plan(plan)
        draft_cost = plan.gemm_ms(1) / max(engine.linear_plan.gemm_ms(1), 1e-9)
        # Non-adaptive speculation is an explicit order to draft k tokens every step (tests,
        # experiments): it is obeyed even where it loses.
        if cfg.adaptive and draft_cost >= MAX_DRAFT_COST:
            log.warning(
                "low_precision drafting switched off on this machine: a %s draft round's matmuls take "
                "%.2f ms against %.2f ms for a %s target step (%.2fx; drafting needs < %.2fx). The CPU "
                "has no native %s matmul; decoding runs without speculation.",
                cfg.draft_dtype, plan.gemm_ms(1), engine.linear_plan.gemm_ms(1), engine.config.dtype,
                draft_cost, MAX_DRAFT_COST, cfg.draft_dtype)
            return None
    return own_kv_drafter(engine, loaded, cfg.draft_dtype, draft_cost)
