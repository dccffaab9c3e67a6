"""Tensor-parallel plan: which sizes fit a model, the per-rank model config, and which slice of
each checkpoint tensor a rank holds (Megatron-style, plain logic, no torch.distributed).

Rank r of N holds attention heads [r H/N, (r+1) H/N) and KV heads [r H_kv/N, (r+1) H_kv/N):
with grouped-query attention, query head h reads KV head h // (H / H_kv), so a contiguous run of
query heads only ever reads the KV heads of the same rank. q/k/v and gate/up are split by output
rows (column-parallel), o_proj and down_proj by input columns (row-parallel, one all-reduce after
each); embeddings, norms and the LM head are replicated.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.models.config import ModelConfig


class TensorParallelError(ValueError):
    """A tensor-parallel size that cannot serve this model here, or a rank that failed; the
    message names the limit or the rank."""


@dataclass(frozen=True, slots=True)
class TensorParallelConfig:
    size: int = 1  # ranks (processes) that each hold 1/size of the heads and of the MLP
    # Bounds: all ranks loaded and connected; one step's collectives; a worker waiting for the
    # next step (an idle engine is fine, so long; a dead rank 0 is noticed by its closed pipe).
    start_timeout_s: float = 120.0
    step_timeout_s: float = 30.0
    idle_timeout_s: float = 7 * 24 * 3600.0
    stop_timeout_s: float = 5.0  # a worker asked to stop is killed after this long

    def __post_init__(self) -> None:
        if self.size < 1:
            raise TensorParallelError(f"tensor parallel size must be >= 1, got {self.size}")
        for name in ("start_timeout_s", "step_timeout_s", "idle_timeout_s", "stop_timeout_s"):
            if getattr(self, name) <= 0:
                raise TensorParallelError(f"{name} must be > 0, got {getattr(self, name)}")


def check_tensor_parallel(cfg: ModelConfig, size: int, device_type: str, device_count: int) -> None:
    """Refuse a size that does not split this model evenly or that needs more devices than
    there are. On CPU ranks are processes sharing the cores (``device_count`` is not a limit
    there: more ranks than cores only oversubscribe them)."""
    if size < 1:
        raise TensorParallelError(f"tensor parallel size must be >= 1, got {size}")
    uneven = [f"{what} ({n})" for what, n in (("attention heads", cfg.num_heads),
                                               ("KV heads", cfg.num_kv_heads),
                                               ("MLP intermediate size", cfg.intermediate_size)) if n % size]
    if uneven:
        raise TensorParallelError(
            f"tensor parallel size {size} does not divide the model's {' and '.join(uneven)}; the model has "
            f"{cfg.num_heads} attention heads and {cfg.num_kv_heads} KV heads, so the size must divide both: "
            f"{', '.join(str(d) for d in fitting_sizes(cfg))} fit")
    if device_type != "cpu" and size > device_count:
        raise TensorParallelError(
            f"tensor parallel size {size} needs {size} {device_type} devices, this machine has {device_count}")


def fitting_sizes(cfg: ModelConfig) -> list[int]:
    """Every tensor-parallel size that splits this model evenly."""
    return [d for d in range(1, cfg.num_kv_heads + 1)
            if cfg.num_heads % d == 0 and cfg.num_kv_heads % d == 0 and cfg.intermediate_size % d == 0]


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config one rank's model is built from: its heads, its KV heads and its share of the
    MLP (head_dim and hidden size unchanged, so RoPE and the norms are the same)."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                               intermediate_size=cfg.intermediate_size // size)


@dataclass(frozen=True, slots=True)
class ShardSlice:
    dim: int  # the tensor dimension split across ranks
    start: int
    length: int


_ROWS = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.", "mlp.up_proj.")
_COLUMNS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def shard_slice(name: str, shape: tuple[int, ...], rank: int, size: int) -> ShardSlice | None:
    """The part of Hugging Face tensor ``name`` (full ``shape``) rank ``rank`` holds, or None for
    a replicated tensor (embeddings, norms, LM head, o_proj's bias: added once, after the sum)."""
    if size == 1 or not name.startswith("model.layers."):
        return None
    if any(part in name for part in _ROWS):
        dim = 0  # column-parallel: output rows (a bias is split with its rows)
    elif name.endswith(_COLUMNS):
        dim = 1  # row-parallel: input columns
    else:
        return None
    n = shape[dim] // size
    return ShardSlice(dim=dim, start=rank * n, length=n)
