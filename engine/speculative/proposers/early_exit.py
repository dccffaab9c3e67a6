"""Self-drafting by early exit (LayerSkip-style): the target's first L layers, its final norm
and its head draft the next tokens. No extra weights and no extra KV: the draft's KV for
layers 0..L-1 is exactly the target's (same weights, same inputs), so the drafter reads and
writes the target's own cache; verification rewrites the draft positions with full-model KV.
"""
from __future__ import annotations

from engine.speculative.proposers.draft_model import ModelDrafter


def from_engine(engine) -> ModelDrafter:
    cfg = engine.config.speculative
    total = engine.model_config.num_layers
    layers = cfg.early_exit_layers or max(1, total // 2)
    if not 1 <= layers < total:
        raise ValueError(f"early_exit_layers must be in [1, {total - 1}] for this model, got {layers}")
    return ModelDrafter(engine.loaded.model, engine.kv_cache, engine.block_size, engine.device,
                        draft_cost=layers / total, num_layers=layers, shares_target_kv=True,
                        eos_token_ids=engine.eos_token_ids, seed=engine.config.seed)
