"""Frozen configuration of one engine instance (one per process role).

The engine's flags (``pdserve up``, ``nodes``, ``generate``, ``chaos``) are declared on these
fields (settings/flags.py); ``deploy/cli.py`` generates them and builds the config from them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from settings.flags import negated, setting

DTYPES = ["float32", "bfloat16", "float16"]
BACKENDS = ("pdserve", "vllm")
SPEC_METHODS = ["off", "ngram", "draft", "early_exit", "low_precision", "medusa", "eagle"]


def mib_to_bytes(mib: int) -> int:
    """``--kv-cache-mib 64``: a budget of 64 MiB, in bytes."""
    return mib * 2**20


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = setting(16, flag="--block-size")
    # KV budget. ``num_blocks`` wins when set; otherwise the budget in bytes is turned into
    # blocks from the model's per-block KV size.
    num_blocks: int | None = None
    kv_cache_bytes: int = setting(512 * 1024 * 1024, flag="--kv-cache-mib", dest="kv_cache_mib", flag_default=512,
                                  to_field=mib_to_bytes)
    enable_prefix_caching: bool = setting(True, flag="--no-prefix-caching", dest="no_prefix_caching",
                                          flag_default=False, action="store_true", to_field=negated)
    # Fraction of all blocks kept free when admitting a *new* request, so running ones can
    # still grow without preempting each other right away.
    watermark: float = 0.01
    # Tiers below the device pool (engine/kv_tiers/, docs/engine.md "KV tiers"): cached blocks
    # are copied to a host buffer of this many MiB (pinned on CUDA; 0 = no tiers), and blocks
    # the host tier evicts are written to files in ``disk_cache_dir`` under a budget of
    # ``disk_cache_mib`` (None = no disk tier). The directory is one engine's: it survives a
    # restart, whose engine re-registers the blocks it finds there. Fractions of a MiB are
    # fine (tests size tiers in blocks of a tiny model).
    host_cache_mib: float = setting(0, flag="--host-cache-mib", help="KV tier in host memory below each node's "
                                    "device pool, MiB (0: none; docs/engine.md)")
    disk_cache_dir: str | None = setting(None, flag="--disk-cache-dir", help="KV tier on disk below the host tier: a "
                                         "directory, one subdirectory per node, kept across restarts (needs "
                                         "--host-cache-mib and --disk-cache-mib)")
    disk_cache_mib: float = setting(0, flag="--disk-cache-mib", help="byte budget of each node's disk KV tier, MiB")

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.host_cache_mib < 0 or self.disk_cache_mib < 0:
            raise ValueError(f"host_cache_mib and disk_cache_mib must be >= 0, got {self.host_cache_mib}, "
                             f"{self.disk_cache_mib}")
        if self.disk_cache_dir:
            if self.disk_cache_mib <= 0:
                raise ValueError("a disk KV cache needs a budget: set disk_cache_mib (--disk-cache-mib) > 0")
            if self.host_cache_mib <= 0:
                raise ValueError("the disk KV cache sits below the host tier (blocks reach disk when the host "
                                 "tier evicts them): set host_cache_mib (--host-cache-mib) > 0 too")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Per-step token budget: decode tokens + prefill chunk tokens.
    max_num_batched_tokens: int = setting(512, flag="--max-num-batched-tokens")
    max_num_seqs: int = setting(64, flag="--max-num-seqs")
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # None -> the model's own context length

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (decode role). The engine only runs the mechanism; the proposer
    named by ``method`` is built by whoever constructs the engine (``engine.speculative.proposers``)."""

    # off | ngram | draft | early_exit | low_precision | medusa | eagle (see docs/speculative.md)
    method: str = setting("off", flag="--spec-method", dest="spec_method", choices=SPEC_METHODS,
                          help="speculative decoding on decode nodes (docs/speculative.md)")
    # k: most draft tokens one sequence verifies per step
    num_speculative_tokens: int = setting(8, flag="--spec-tokens", dest="spec_tokens",
                                          help="most draft tokens per sequence and step")
    ngram_min: int = 1  # n-gram prompt lookup: shortest / longest suffix matched
    ngram_max: int = setting(8, flag="--spec-ngram-max", dest="spec_ngram_max")
    draft_model: str | None = setting(None, flag="--spec-draft-model", dest="spec_draft_model",
                                      help="draft: model dir or builtin; medusa, eagle: checkpoint dir")
    # draft and low_precision: dtype of the draft's weights and KV
    draft_dtype: str = setting("bfloat16", flag="--spec-draft-dtype", dest="spec_draft_dtype", choices=DTYPES)
    # early_exit: target layers the draft runs (None: half)
    early_exit_layers: int | None = setting(None, flag="--spec-early-exit-layers", dest="spec_early_exit_layers")
    # k per request from observed acceptance; off when it does not pay
    adaptive: bool = setting(True, flag="--no-spec-adaptive", dest="no_spec_adaptive", flag_default=False,
                             action="store_true", to_field=negated, help="always draft spec-tokens tokens")
    # Per-step speculative token budget at batch 1; it shrinks linearly to 0 at
    # ``max_batch_size`` running sequences (verification is not free at large batch).
    max_tokens_per_step: int = 64
    max_batch_size: int = 64
    # Prior cost of a verification step relative to a plain decode step at batch 1, until steps
    # are timed: 1 + verify_fixed_cost + k * verify_token_cost. One row vs a small GEMM is the
    # jump; extra rows cost little because the weights are read once either way. On CPU the
    # kernel plan's measured matmul curve replaces it (`pdserve bench verify-cost` measures the
    # real ratio: docs/benchmarks.md).
    verify_fixed_cost: float = 0.5
    verify_token_cost: float = 0.03

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.early_exit_layers is not None and self.early_exit_layers < 1:
            raise ValueError(f"early_exit_layers must be >= 1, got {self.early_exit_layers}")
        if self.max_tokens_per_step < 0 or self.max_batch_size < 1:
            raise ValueError("max_tokens_per_step must be >= 0 and max_batch_size >= 1")
        if self.verify_token_cost < 0 or self.verify_fixed_cost < 0:
            raise ValueError("verify_fixed_cost and verify_token_cost must be >= 0")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # builtin name or local Hugging Face directory / GGUF file
    model: str = setting("smollm2-135m", flag="--model", help="builtin name or local HF directory / .gguf file")
    dtype: str = setting("float32", flag="--dtype", choices=DTYPES)
    device: str = setting("auto", flag="--device")  # auto -> cuda when available else cpu
    seed: int = 0
    # torch intra-op threads on CPU; None keeps torch's default
    num_threads: int | None = setting(None, flag="--threads", dest="threads",
                                      help="torch CPU threads (default: torch's)")
    # CPU kernels: "auto" measures the matmul candidates once per machine and model shapes
    # (cached; see engine/models/cpu_linear.py) and, for bfloat16, builds the native decode
    # attention (engine/attention/cpu_decode.py); "torch" keeps F.linear and SDPA everywhere.
    cpu_kernels: str = "auto"
    # Which engine a node runs: pdserve's own, or vLLM in a child process under vLLM's Python
    # (decode nodes that prefill their own prompts: node/vllm_engine.py, docs/cluster.md).
    backend: str = setting("pdserve", flag="--engine", dest="engine_backend", choices=BACKENDS,
                           help="the nodes' engine: pdserve's own, or vLLM (`make vllm` builds its environment)")
    vllm_python: str | None = setting(None, flag="--vllm-python", help="vLLM's Python for --engine vllm (default "
                                      "$PDSERVE_VLLM_PYTHON, then .venv-vllm/bin/python)")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if self.cpu_kernels not in ("auto", "torch"):
            raise ValueError(f"cpu_kernels must be 'auto' or 'torch', got {self.cpu_kernels!r}")


# The configs whose fields declare the engine's flags, in the order the flags are added.
ENGINE_CONFIGS = (EngineConfig, CacheConfig, SchedulerConfig, SpeculativeConfig)
