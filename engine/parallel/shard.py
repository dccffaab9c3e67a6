"""One rank's model: its slice of every split tensor read from the same checkpoint as TP 1 (only
that slice's bytes leave the file), and the row-parallel projections that sum over ranks.

The rank's model is an ordinary ``LlamaForCausalLM`` built from ``shard_config`` (its heads, its
share of the MLP), so attention, RoPE and the paged KV cache run unchanged on fewer heads; after
loading, o_proj and down_proj are wrapped so that their partial products are all-reduced.
"""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from engine.models.llama import Linear, LlamaForCausalLM
from engine.models.loader import LoadedModel, ModelLoadError, read_model_config
from engine.parallel.plan import shard_config, shard_slice


def load_shard(directory: Path, rank: int, size: int, dtype: torch.dtype, device: torch.device,
               fingerprint: str) -> LoadedModel:
    """Rank ``rank`` of ``size``'s model from the local HF ``directory`` (already resolved and
    checked by the caller); the returned config is the rank's (``shard_config``)."""
    from safetensors import SafetensorError, safe_open

    cfg = shard_config(read_model_config(directory), size)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for file in sorted(directory.glob("*.safetensors")):
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        part = f.get_slice(name)
                        cut = shard_slice(name, tuple(part.get_shape()), rank, size)
                        if cut is None:
                            yield name, part[:]
                        elif cut.dim == 0:
                            yield name, part[cut.start : cut.start + cut.length]
                        else:
                            yield name, part[:, cut.start : cut.start + cut.length]
            except SafetensorError as e:
                raise ModelLoadError(f"corrupt safetensors file {file}: {e}") from e

    try:
        model.load_weights(stream())
    except ValueError as e:
        raise ModelLoadError(f"rank {rank} of {size}: {e}") from e
    model = model.eval().requires_grad_(False)
    return LoadedModel(model=model, config=cfg, tokenizer_path=directory, fingerprint=fingerprint)


class RowParallelLinear(nn.Module):
    """``inner`` over this rank's input columns, summed over all ranks (one all-reduce), then
    the bias once: y = sum_r x_r W_r^T + b, identical on every rank."""

    def __init__(self, inner: Linear, group, timeout_s: float):
        super().__init__()
        self.inner = inner
        self.bias = inner.bias
        inner.bias = None
        self.group = group
        self.timeout = timedelta(seconds=timeout_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / N] -> [T, out]
        y = self.inner(x).contiguous()  # [T, out], this rank's partial sum
        all_reduce(self.group, y, self.timeout)
        return y if self.bias is None else y + self.bias


def all_reduce(group, t: torch.Tensor, timeout: timedelta) -> None:
    """Sum ``t`` over the group in place; raises (RuntimeError from gloo) when a rank is gone or
    the sum does not complete within ``timeout``."""
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    opts.timeout = timeout
    group.allreduce([t], opts).wait()


def make_row_parallel(model: LlamaForCausalLM, group, timeout_s: float) -> None:
    """Wrap every o_proj and down_proj of ``model`` (loaded from its shard) in RowParallelLinear."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, group, timeout_s)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, group, timeout_s)
