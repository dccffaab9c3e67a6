"""Frozen configuration of one engine instance (one per process role).

CLI flags and (later) Helm values map onto these fields one to one.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # KV budget. ``num_blocks`` wins when set; otherwise the budget in bytes is turned into
    # blocks from the model's per-block KV size.
    num_blocks: int | None = None
    kv_cache_bytes: int = 512 * 1024 * 1024
    enable_prefix_caching: bool = True
    # Fraction of all blocks kept free when admitting a *new* request, so running ones can
    # still grow without preempting each other right away.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Per-step token budget: decode tokens + prefill chunk tokens.
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    # Prompts up to this many tokens may be prefilled alongside decodes in one step; the
    # budget above still bounds the step.
    max_model_len: int | None = None  # None -> the model's own context length

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2-135m"  # builtin name or local Hugging Face directory / GGUF file
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "auto"  # auto -> cuda when available else cpu
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None keeps torch's default
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
