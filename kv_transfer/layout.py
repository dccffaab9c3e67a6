"""The fixed KV pool layout shared by every engine, and its dtype names on the wire.

    kv_cache: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
    kv_cache[l, b] is block b of layer l; [..., 0, ...] is K and [..., 1, ...] is V.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from protos.pdserve.v1 import kv_pb2

_TO_WIRE: dict[torch.dtype, int] = {
    torch.float32: kv_pb2.DTYPE_FLOAT32,
    torch.float16: kv_pb2.DTYPE_FLOAT16,
    torch.bfloat16: kv_pb2.DTYPE_BFLOAT16,
}
_FROM_WIRE: dict[int, torch.dtype] = {v: k for k, v in _TO_WIRE.items()}


def dtype_to_wire(dtype: torch.dtype) -> int:
    if dtype not in _TO_WIRE:
        raise ValueError(f"KV dtype {dtype} has no wire name; supported: {sorted(map(str, _TO_WIRE))}")
    return _TO_WIRE[dtype]


def dtype_from_wire(value: int) -> torch.dtype | None:
    """None for a value this build does not know (validation reports it)."""
    return _FROM_WIRE.get(value)


@dataclass(frozen=True, slots=True)
class PoolLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, pool: torch.Tensor) -> PoolLayout:
        if pool.dim() != 6 or pool.shape[2] != 2:
            raise ValueError(
                "KV pool must be [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim], "
                f"got shape {tuple(pool.shape)}"
            )
        if not pool.is_contiguous():
            raise ValueError("KV pool must be contiguous")
        num_layers, num_blocks, _, block_size, num_kv_heads, head_dim = pool.shape
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, pool.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """One block of one layer: [2, block_size, num_kv_heads, head_dim]."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize
