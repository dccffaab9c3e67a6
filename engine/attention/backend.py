"""The interface every attention backend implements (torch reference on CPU, flashinfer on CUDA)."""
from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Paged attention for one step, shared by every layer of the model.

    Call order per step: ``begin_step(meta)`` once, then ``forward(layer, ...)`` once per layer.
    A backend holds only per-step derived structures (gather indices, masks, a flashinfer plan);
    it owns no KV memory. ``forward`` mutates ``kv_cache_layer`` (writes the new K/V at
    ``meta.slot_mapping``) and nothing else.
    """

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Precompute what every layer of this step reuses."""
        ...

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H_q, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        kv_cache_layer: torch.Tensor,  # [N, 2, block_size, H_kv, D]
    ) -> torch.Tensor:  # [T, H_q, D]
        """Write k/v into the cache, then attend per the rule in ``metadata.py``."""
        ...


def slot_rows(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Map slots to K rows of a layer viewed flat as ``[N * 2 * block_size, H_kv, D]``.

    Slot ``b * bs + o`` lives at row ``b * 2 * bs + o`` for K and ``bs`` rows further for V
    (K and V of one block are adjacent halves). Backends compute this once per step.
    """
    return (slots // block_size) * (2 * block_size) + slots % block_size


def flat_layer(kv_cache_layer: torch.Tensor) -> torch.Tensor:
    """[N, 2, bs, H_kv, D] -> [N * 2 * bs, H_kv, D] view (the cache is contiguous)."""
    n, two, bs, h, d = kv_cache_layer.shape
    return kv_cache_layer.view(n * two * bs, h, d)


def write_kv(
    kv_cache_layer: torch.Tensor,  # [N, 2, bs, H_kv, D]
    k: torch.Tensor,  # [T, H_kv, D]
    v: torch.Tensor,  # [T, H_kv, D]
    k_rows: torch.Tensor,  # [T] int64, slot_rows(slot_mapping)
) -> None:
    """Scatter the step's new K/V into their slots; index_copy_ on a view writes the cache."""
    flat = flat_layer(kv_cache_layer)
    bs = kv_cache_layer.shape[2]
    flat.index_copy_(0, k_rows, k.to(flat.dtype))
    flat.index_copy_(0, k_rows + bs, v.to(flat.dtype))
