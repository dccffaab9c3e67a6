"""One decoder for the Llama family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

Numerics follow transformers so logits match it: RMSNorm statistics in float32, RoPE angles in
float32 with transformers' inv_freq formula, softmax inside SDPA in float32 for float32 models.
q/k/v and gate/up are fused into one matmul each; ``load_weights`` maps Hugging Face tensor
names onto row slices of the fused weights.

RoPE tables hold one row per absolute position, and a row depends only on its position, never
on the batch: KV written at position p in one step must be reusable (prefix cache, KV transfer)
in any later one. For the length-dependent RoPE types this means:

* ``dynamic`` (NTK): positions below ``max_position_embeddings`` use the unscaled frequencies;
  position p beyond it uses the base transformers computes for a sequence of length p + 1;
* ``longrope``: short factors below ``original_max_position_embeddings``, long factors from it on.

Both equal what transformers computes when it decodes token by token; a single prefill that
crosses the threshold differs from transformers (which rescales the whole prompt), by design.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.models.config import ModelConfig
from engine.models.cpu_linear import LinearPlan


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:  # [dim / 2] float32
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base**exponent)


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(base: float, dim: int, p: dict[str, Any]) -> torch.Tensor:
    factor, orig = p["factor"], p["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p["beta_fast"]), correction_dim(p["beta_slow"])
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 = keep the original frequency (high-frequency dims)
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding(nn.Module):
    """Lazily grown cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.max_position = max_position
        self.rope_type = scaling["rope_type"] if scaling else "default"
        self.attention_factor = float(scaling.get("attention_factor", 1.0)) if scaling else 1.0
        # Always on the host in float32, whatever device context the model is built under.
        with torch.device("cpu"):
            inv_freq = _base_inv_freq(theta, head_dim)
            if self.rope_type == "linear":
                inv_freq = inv_freq / scaling["factor"]
            elif self.rope_type == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            elif self.rope_type == "yarn":
                inv_freq = _yarn_inv_freq(theta, head_dim, scaling)
            elif self.rope_type == "longrope":
                short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
                inv_freq = 1.0 / (short * theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self._inv_freq = inv_freq  # [D / 2] float32, for positions where no length rule applies
        # Grown by _ensure; half-width tables since both halves of a head share one angle.
        self._cos: torch.Tensor | None = None  # [P, D / 2] in the model dtype
        self._sin: torch.Tensor | None = None

    def _inv_freq_rows(self, n: int) -> torch.Tensor:  # [n, D / 2] float32, row p for position p
        rows = self._inv_freq.expand(n, -1)
        if self.rope_type == "dynamic" and n > self.max_position:
            seq_len = torch.arange(n, dtype=torch.float64) + 1
            seq_len = torch.clamp(seq_len, min=self.max_position)
            d, f = self.head_dim, self.scaling["factor"]
            base = self.theta * ((f * seq_len / self.max_position) - (f - 1)) ** (d / (d - 2))
            exponent = torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d
            scaled = 1.0 / (base.to(torch.float32)[:, None] ** exponent[None, :])
            rows = torch.where((seq_len > self.max_position)[:, None], scaled, rows)
        elif self.rope_type == "longrope":
            orig = self.scaling["original_max_position_embeddings"]
            if n > orig:
                long = torch.tensor(self.scaling["long_factor"], dtype=torch.float32)
                exponent = torch.arange(0, self.head_dim, 2).float() / self.head_dim
                long_inv = 1.0 / (long * self.theta**exponent)
                is_long = (torch.arange(n) >= orig)[:, None]
                rows = torch.where(is_long, long_inv[None, :], rows)
        return rows

    def _ensure(self, needed: int, dtype: torch.dtype, device: torch.device) -> None:
        have = 0 if self._cos is None else self._cos.shape[0]
        if have >= needed and self._cos.dtype == dtype and self._cos.device == device:
            return
        size = max(256, 1 << (max(needed, have) - 1).bit_length())
        pos = torch.arange(size, dtype=torch.int64).to(torch.float32)[:, None]  # [P, 1]
        freqs = pos * self._inv_freq_rows(size)  # [P, D / 2] float32
        self._cos = (freqs.cos() * self.attention_factor).to(device=device, dtype=dtype)
        self._sin = (freqs.sin() * self.attention_factor).to(device=device, dtype=dtype)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        max_position: int,  # max(positions) + 1, computed once per step by the model
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [T, 1, D / 2] each, shared by all layers
        self._ensure(max_position, dtype, positions.device)
        return self._cos[positions][:, None, :], self._sin[positions][:, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same arithmetic as transformers' x * cos + rotate_half(x) * sin with cos = cat(c, c):
    # first half x1*c - x2*s, second half x2*c + x1*s.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Linear(nn.Module):
    """y = x W^T (+ b) with uninitialized parameters: load_weights fills every one of them, so
    nn.Linear's random init (seconds for a real model) would be wasted. With a kernel plan set
    (CPU), the matmul kernel is the one measured fastest for this shape and row count."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.plan: LinearPlan | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.plan is None:
            return F.linear(x, self.weight, self.bias)
        return self.plan.kernel(self.weight.shape, x.shape[0])(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))  # filled by load_weights

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        # Statistics in float32 whatever the model dtype, cast back before the weight (as HF does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        # q, k and v in one matmul: rows [0, q) are q_proj, then k_proj, then v_proj.
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D / 2]
        sin: torch.Tensor,
        kv_cache_layer: torch.Tensor,  # [N, 2, bs, H_kv, D]
        attn: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H_q, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, H_kv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = attn.forward(self.layer, q, k, v, kv_cache_layer)  # [T, H_q, D]
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        # gate and up in one matmul: rows [0, I) are gate_proj, [I, 2I) up_proj.
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, kv_cache_layer, attn) -> torch.Tensor:  # [T, hidden]
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache_layer, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 decoder over a paged KV cache.

    The caller has run ``attn.begin_step(meta)`` for this step's metadata; ``forward`` then
    writes the new tokens' K/V into ``kv_cache`` and returns final-normed hidden states.
    Parameters hold fused projections (qkv_proj, gate_up_proj); ``load_weights`` maps
    Hugging Face names onto slices of them.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        # Tied models read the embedding matrix for logits; no second copy.
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.linear_plan: LinearPlan | None = None

    def matmul_weights(self) -> list[torch.Tensor]:
        """Every matrix one forward multiplies by, in the order it reads them (logits last)."""
        out = [m.weight for layer in self.layers for m in layer.modules() if isinstance(m, Linear)]
        return out + [self._logits_weight()]

    def set_linear_plan(self, plan: LinearPlan | None) -> None:
        """Use ``plan``'s kernels in every matmul (None: torch's defaults)."""
        self.linear_plan = plan
        for m in self.modules():
            if isinstance(m, Linear):
                m.plan = plan

    def _logits_weight(self) -> torch.Tensor:  # [vocab, hidden]
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [L, N, 2, bs, H_kv, D]
        attn: AttentionBackend,
        num_layers: int | None = None,  # run only the first layers (early exit for self-drafting)
    ) -> torch.Tensor:  # [T, hidden]
        return self.forward_states(input_ids, positions, kv_cache, attn, num_layers)[0]

    def forward_states(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [L, N, 2, bs, H_kv, D]
        attn: AttentionBackend,
        num_layers: int | None = None,
        capture_layer: int | None = None,
        after_layer: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward`` that also returns the residual stream after decoder layer
        ``capture_layer`` (before any norm; None: not kept) -> ([T, hidden], [T, hidden] | None).
        ``after_layer(i)`` runs once decoder layer i has written this step's K/V into
        ``kv_cache[i]`` (layer-wise KV streaming; on CUDA the write is only enqueued then)."""
        n = self.cfg.num_layers if num_layers is None else num_layers
        if not 1 <= n <= self.cfg.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.cfg.num_layers}], got {n}")
        if capture_layer is not None and not 0 <= capture_layer < n:
            raise ValueError(f"capture_layer must be in [0, {n - 1}], got {capture_layer}")
        max_position = int(positions.max()) + 1 if positions.numel() else 1
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rope(positions, max_position, h.dtype)
        captured = None
        for i in range(n):
            h = self.layers[i](h, cos, sin, kv_cache[i], attn)
            if i == capture_layer:
                captured = h
            if after_layer is not None:
                after_layer(i)
        return self.norm(h), captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] f32
        weight = self._logits_weight()
        if self.linear_plan is None:
            return F.linear(hidden, weight).float()
        return self.linear_plan.kernel(weight.shape, hidden.shape[0])(hidden, weight, None).float()

    # ------------------------------------------------------------------ weights

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors into the (fused) parameters; strict.

        Every parameter slice must be set exactly once: an unknown name, a repeated one or a
        shape mismatch raises ValueError naming the tensor, and so does any slice left unset.
        A tied model may carry its matrix as ``model.embed_tokens.weight``, ``lm_head.weight``
        or both.
        """
        targets = weight_targets(self.cfg)
        params = dict(self.named_parameters())
        filled: set[tuple[str, int]] = set()
        for name, tensor in named_tensors:
            if is_ignored_weight(name):
                continue
            target = targets.get(name)
            if target is None:
                raise ValueError(f"unexpected tensor {name!r} for {self.cfg.architecture}")
            if tuple(tensor.shape) != target.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {target.shape}")
            slot = (target.param, target.start)
            if slot in filled:
                if name in TIED_NAMES and self.cfg.tie_word_embeddings:
                    continue
                raise ValueError(f"tensor {name!r} given twice")
            with torch.no_grad():
                params[target.param].narrow(0, target.start, target.shape[0]).copy_(tensor)
            filled.add(slot)
        missing = missing_weights(self.cfg, filled)
        if missing:
            raise ValueError(f"missing tensors: {short_list(missing)}")


class WeightTarget(NamedTuple):
    param: str  # our parameter name
    start: int  # first row of the slice along dim 0
    shape: tuple[int, ...]  # the Hugging Face tensor's shape


TIED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def is_ignored_weight(name: str) -> bool:
    # Older checkpoints saved the RoPE buffer; it is recomputed from the config.
    return name.endswith("rotary_emb.inv_freq")


def weight_targets(cfg: ModelConfig) -> dict[str, WeightTarget]:
    """Hugging Face tensor name -> where it goes in LlamaForCausalLM (static, no model needed)."""
    h, q, kv, i, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim
    t: dict[str, WeightTarget] = {
        "model.embed_tokens.weight": WeightTarget("embed_tokens.weight", 0, (cfg.vocab_size, h)),
        "model.norm.weight": WeightTarget("norm.weight", 0, (h,)),
    }
    lm = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    t["lm_head.weight"] = WeightTarget(lm, 0, (cfg.vocab_size, h))
    for n in range(cfg.num_layers):
        src, dst = f"model.layers.{n}.", f"layers.{n}."
        qkv = dst + "self_attn.qkv_proj."
        kinds = ["weight"] + (["bias"] if cfg.attention_bias else [])
        for kind in kinds:
            tail = (h,) if kind == "weight" else ()
            t[src + f"self_attn.q_proj.{kind}"] = WeightTarget(qkv + kind, 0, (q, *tail))
            t[src + f"self_attn.k_proj.{kind}"] = WeightTarget(qkv + kind, q, (kv, *tail))
            t[src + f"self_attn.v_proj.{kind}"] = WeightTarget(qkv + kind, q + kv, (kv, *tail))
        t[src + "self_attn.o_proj.weight"] = WeightTarget(dst + "self_attn.o_proj.weight", 0, (h, q))
        if cfg.o_proj_bias:
            t[src + "self_attn.o_proj.bias"] = WeightTarget(dst + "self_attn.o_proj.bias", 0, (h,))
        if cfg.qk_norm:
            t[src + "self_attn.q_norm.weight"] = WeightTarget(dst + "self_attn.q_norm.weight", 0, (d,))
            t[src + "self_attn.k_norm.weight"] = WeightTarget(dst + "self_attn.k_norm.weight", 0, (d,))
        t[src + "mlp.gate_proj.weight"] = WeightTarget(dst + "mlp.gate_up_proj.weight", 0, (i, h))
        t[src + "mlp.up_proj.weight"] = WeightTarget(dst + "mlp.gate_up_proj.weight", i, (i, h))
        t[src + "mlp.down_proj.weight"] = WeightTarget(dst + "mlp.down_proj.weight", 0, (h, i))
        t[src + "input_layernorm.weight"] = WeightTarget(dst + "input_layernorm.weight", 0, (h,))
        t[src + "post_attention_layernorm.weight"] = WeightTarget(dst + "post_attention_layernorm.weight", 0, (h,))
    return t


def missing_weights(cfg: ModelConfig, filled: set[tuple[str, int]]) -> list[str]:
    """Hugging Face names of the slots not in ``filled`` (tied aliases count once)."""
    out = []
    for name, target in weight_targets(cfg).items():
        if (target.param, target.start) in filled:
            continue
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # reported under model.embed_tokens.weight
        out.append(name)
    return out


def short_list(names: list[str], limit: int = 8) -> str:
    more = f" ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
