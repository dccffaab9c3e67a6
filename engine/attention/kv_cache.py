"""The paged KV cache: one tensor for all layers.

Layout ``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`` (index 0 = K, 1 = V),
so ``kv_cache[layer]`` is flashinfer's NHD paged layout ``[num_pages, 2, page_size, H_kv, D]`` and
one block of one layer (K and V together) is one contiguous chunk: a block moves between nodes
as ``num_layers`` contiguous copies.

A token's slot is ``block_id * block_size + offset``; viewing a layer as
``[num_blocks * block_size]`` rows per K/V half is what the backends index with slot_mapping.
"""
from __future__ import annotations

from typing import Protocol

import torch


class KVShape(Protocol):
    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_cache_shape(cfg: KVShape, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (cfg.num_layers, num_blocks, 2, block_size, cfg.num_kv_heads, cfg.head_dim)


def bytes_per_block(cfg: KVShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def allocate_kv_cache(
    cfg: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    # Zeros, not empty: padded gathers read unwritten slots, and NaN garbage times a zero
    # attention weight would still be NaN.
    return torch.zeros(kv_cache_shape(cfg, num_blocks, block_size), dtype=dtype, device=device)


def copy_blocks(kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks (every layer, K and V) src -> dst, for copy-on-write.

    ``kv_cache``: [L, N, 2, bs, H_kv, D]; mutated in place. All sources are read before any
    destination is written, so chains like [(1, 2), (2, 3)] copy the old block 2.
    """
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=kv_cache.device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=kv_cache.device)
    kv_cache[:, dst] = kv_cache[:, src]  # [L, P, 2, bs, H_kv, D]
