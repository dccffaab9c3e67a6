"""Attention backends over the paged KV cache; ``get_attention_backend`` picks one per device."""
from __future__ import annotations

import importlib.util

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.cpu_decode import DecodeKernel
from engine.attention.torch_ref import TorchRefBackend


def get_attention_backend(
    device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    decode_kernel: DecodeKernel | None = None,
) -> AttentionBackend:
    """flashinfer on CUDA when it is installed and the dtype is half precision, else torch_ref.

    flashinfer's kernels take fp16/bf16 only; a float32 model on CUDA runs the torch reference
    backend (SDPA works on any device). ``decode_kernel`` (CPU, bfloat16 only) serves the torch
    reference backend's decodes; float32 keeps SDPA, whose results match transformers exactly.
    """
    device = torch.device(device)
    half = dtype in (torch.float16, torch.bfloat16)
    if device.type == "cuda" and half and importlib.util.find_spec("flashinfer") is not None:
        from engine.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(num_heads, num_kv_heads, head_dim, dtype, device)
    if decode_kernel is not None and (device.type != "cpu" or dtype != torch.bfloat16):
        decode_kernel = None
    return TorchRefBackend(num_heads, num_kv_heads, head_dim, decode_kernel=decode_kernel)
