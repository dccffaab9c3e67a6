"""The model's shape, parsed once from a Hugging Face ``config.json`` dict.

Only the Llama family is supported: one decoder (``engine/models/llama.py``) covers Llama,
Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm). Everything architecture-specific
is turned into a plain field here, so the model code never checks names.

Sliding-window attention (Mistral v0.1, Qwen2 with ``use_sliding_window``) is not implemented.
Within the window it equals full attention, so such a model is accepted with its usable context
capped at the window (``max_model_len``); the engine never runs a sequence past it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# Values of rope_scaling["rope_type"] that the model's RoPE implements.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


class UnsupportedModelError(ValueError):
    """The config describes a model this engine cannot run (architecture or feature)."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else a dict with "rope_type" in ROPE_TYPES and that type's parameters.
    rope_scaling: dict[str, Any] | None = field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always, Llama when configured)
    o_proj_bias: bool  # bias on the output projection (Llama's attention_bias covers o_proj too)
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None  # None when every layer attends fully

    @property
    def max_model_len(self) -> int:
        """Longest sequence the engine may run: the window caps it where one applies."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_hf(d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported model architecture {arch!r} (model_type {d.get('model_type')!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"{arch}: hidden_act {d.get('hidden_act')!r} is not supported (silu only)")
        if d.get("mlp_bias"):
            raise UnsupportedModelError(f"{arch}: mlp_bias=True is not supported")

        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise UnsupportedModelError(f"{arch}: num_attention_heads {heads} not a multiple of kv heads {kv_heads}")
        head_dim = int(d.get("head_dim") or hidden // heads)
        max_pos = int(d.get("max_position_embeddings") or 2048)
        theta, scaling = _normalize_rope(d, max_pos)
        model_type = str(d.get("model_type") or "")
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(d.get("attention_bias", False))

        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        return ModelConfig(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            qk_norm=model_type == "qwen3",
            bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
            eos_token_ids=eos_ids,
            sliding_window=_effective_sliding_window(d),
        )


def _effective_sliding_window(d: dict[str, Any]) -> int | None:
    window = d.get("sliding_window")
    if window is None:
        return None
    # Qwen2/Qwen3 carry a window they do not use unless use_sliding_window is set; transformers 5
    # also writes per-layer types, and a model whose layers are all full ignores the window.
    if "use_sliding_window" in d and not d["use_sliding_window"]:
        return None
    layer_types = d.get("layer_types")
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _normalize_rope(d: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, scaling) from either transformers 4 or 5 config layouts.

    transformers 4 writes ``rope_theta`` and ``rope_scaling`` ({"type" | "rope_type", ...});
    transformers 5 writes one ``rope_parameters`` dict that holds rope_theta too.
    """
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("per-layer-type RoPE parameters are not supported")
    merged = {**legacy, **params}
    theta = float(merged.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    if float(merged.get("partial_rotary_factor", d.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    merged.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
    out: dict[str, Any] = {"rope_type": rope_type}
    orig = merged.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    if rope_type in ("linear", "dynamic"):
        out["factor"] = float(merged["factor"])
    elif rope_type == "llama3":
        out.update(
            factor=float(merged["factor"]),
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(orig or max_pos),
        )
    elif rope_type == "yarn":
        orig = int(orig or max_pos)
        factor = merged.get("factor")
        factor = float(factor) if factor is not None else max_pos / orig
        attn = merged.get("attention_factor")
        if attn is None:
            mscale, mscale_all = merged.get("mscale"), merged.get("mscale_all_dim")
            if mscale and mscale_all:
                attn = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
            else:
                attn = _yarn_mscale(factor)
        out.update(
            factor=factor,
            original_max_position_embeddings=orig,
            beta_fast=float(merged.get("beta_fast") or 32),
            beta_slow=float(merged.get("beta_slow") or 1),
            truncate=bool(merged.get("truncate", True)),
            attention_factor=float(attn),
        )
    elif rope_type == "longrope":
        orig = int(orig or max_pos)
        factor = merged.get("factor")
        factor = float(factor) if factor is not None else max_pos / orig
        attn = merged.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        out.update(
            short_factor=[float(x) for x in merged["short_factor"]],
            long_factor=[float(x) for x in merged["long_factor"]],
            original_max_position_embeddings=orig,
            attention_factor=float(attn),
        )
    return theta, out


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    # YaRN's attention temperature: sqrt(1/t) = 0.1 ln(s) + 1 (paper, eq. 22).
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
