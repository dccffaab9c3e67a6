"""EAGLE drafting: one extra decoder layer that runs on the target's features (Li et al. 2024).

The draft layer takes, at position p, the embedding of token x_p and the target's feature at
p - 1 (the final-normed hidden state that produced x_p), fused by ``fc``, and predicts the
target's feature at p; the target's own LM head turns that into the draft token for p + 1.
Further drafts feed the draft's predicted feature back in place of the target's::

    positions      ... t-1      t          t+1        t+2
    target feats   f(t-1) -----+
    tokens                   x_t (last)  d1         d2
    draft input          (x_t, f(t-1))  (d1, g_t)  (d2, g_t+1)
    draft output             g_t        g_t+1      ...       lm_head(g) -> d1, d2, d3

Checkpoint directory (EAGLE-1's layout, safetensors)::

    config.json        a LlamaConfig of the draft layer (hidden_size, num_attention_heads,
                       num_key_value_heads, intermediate_size, rms_norm_eps, rope_theta,
                       vocab_size, ...); num_hidden_layers must be 1
    model.safetensors  fc.weight [H, 2H] (fc.bias [H] optional),
                       layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
                       layers.0.post_attention_layernorm.weight, layers.0.input_layernorm.weight
                       (optional: EAGLE-1's layer has none), embed_tokens.weight (optional, ignored:
                       the target's embedding is used)

Features are the target's *final-normed* hidden states (``TargetStates("final")``), so the
draft output goes through the LM head without a norm; a checkpoint trained on pre-norm
features would declare ``TargetStates("final", layer=num_layers - 1)`` (the runner hands over
any layer's residual stream) and apply the target's norm before the head.

KV of the draft layer: one layer is ~1/30 of the target's KV, so it lives in a dense per-
sequence tensor, not the paged pool. Positions enter it only when their inputs are final (the
target's feature and an accepted token); draft positions are computed on top and discarded.
A position whose previous feature this node never saw (prompt KV that came from a prefill node
or the prefix cache) has no draft KV: the draft layer's context then starts at the first
position decoded here, which costs acceptance, never exactness. A preemption resets it.

Drafts are argmaxes (q one-hot), so verification stays exact at any temperature.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.llama import MLP, Attention, Linear, RMSNorm, weight_targets
from engine.speculative.proposer import DraftRequest, Proposal, TargetStates


class EagleLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, fc_bias: bool, input_norm: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(cfg, 0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        emb: torch.Tensor,  # [n, H] embeddings of the tokens at the positions
        feat: torch.Tensor,  # [n, H] features of the positions before them
        cos: torch.Tensor,  # [n, 1, D / 2]
        sin: torch.Tensor,
        attn: "_DenseAttention",
    ) -> torch.Tensor:  # [n, H] predicted features at the positions
        x = self.fc(torch.cat((emb, feat), dim=-1))
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, None, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class _DenseAttention:
    """Attention of ``n`` new positions over ``past`` plus themselves, for one sequence; the
    new K/V are left in ``new_k`` / ``new_v`` for the caller to keep or drop."""

    def __init__(self, num_heads: int, num_kv_heads: int) -> None:
        self.group = num_heads // num_kv_heads
        self.past_k: torch.Tensor | None = None  # [P, H_kv, D]
        self.past_v: torch.Tensor | None = None
        self.new_k = self.new_v = None

    def forward(self, layer, q, k, v, kv_cache_layer) -> torch.Tensor:  # q [n, H_q, D] -> [n, H_q, D]
        self.new_k, self.new_v = k, v
        keys = k if self.past_k is None else torch.cat((self.past_k, k))  # [P + n, H_kv, D]
        vals = v if self.past_v is None else torch.cat((self.past_v, v))
        n, total = q.shape[0], keys.shape[0]
        # Query i sits at past + i and sees every key up to it.
        ar = torch.arange(total, device=q.device)
        mask = ar[None, :] <= ar[total - n :, None]  # [n, P + n]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1).repeat_interleave(self.group, 0),
            vals.transpose(0, 1).repeat_interleave(self.group, 0), attn_mask=mask)  # [H_q, n, D]
        return out.transpose(0, 1)


@dataclass(slots=True)
class _SeqState:
    preemptions: int
    k: torch.Tensor | None = None  # [P, H_kv, D] draft-layer keys of positions [start, start + P)
    v: torch.Tensor | None = None
    start: int = 0
    feats: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # target features not yet used

    @property
    def end(self) -> int:
        return self.start + (0 if self.k is None else self.k.shape[0])


def load_eagle(path: str | Path, target_cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> EagleLayer:
    from safetensors.torch import load_file

    path = Path(path)
    d = json.loads((path / "config.json").read_text())
    if int(d.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"EAGLE checkpoint {path}: num_hidden_layers must be 1, got {d['num_hidden_layers']}")
    d = {**d, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    cfg = ModelConfig.from_hf(d)
    if cfg.hidden_size != target_cfg.hidden_size or cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"EAGLE layer is for hidden {cfg.hidden_size} / vocab {cfg.vocab_size}, "
                         f"the model has {target_cfg.hidden_size} / {target_cfg.vocab_size}")
    tensors = load_file(str(path / "model.safetensors"))
    layer = EagleLayer(cfg, fc_bias="fc.bias" in tensors, input_norm="layers.0.input_layernorm.weight" in tensors)
    params = dict(layer.named_parameters())
    targets = weight_targets(cfg)
    filled = set()
    for name, t in tensors.items():
        if name == "embed_tokens.weight":
            continue
        if name.startswith("fc."):
            dst, start = name, 0
        else:
            tgt = targets.get("model." + name)
            if tgt is None or not tgt.param.startswith("layers.0."):
                raise ValueError(f"EAGLE checkpoint {path}: unexpected tensor {name!r}")
            dst, start = tgt.param[len("layers.0."):], tgt.start
        p = params[dst]
        if t.shape[0] + start > p.shape[0] or tuple(t.shape[1:]) != tuple(p.shape[1:]):
            raise ValueError(f"EAGLE checkpoint {path}: tensor {name!r} has shape {tuple(t.shape)}")
        with torch.no_grad():
            p.narrow(0, start, t.shape[0]).copy_(t)
        filled.add((dst, start))
    need = {(n, 0) for n in params if n.startswith("fc.")}
    need |= {(tg.param[len("layers.0."):], tg.start) for hf, tg in targets.items()
             if hf.startswith("model.layers.0.") and "input_layernorm" not in hf}
    if layer.input_layernorm is not None:
        need.add(("input_layernorm.weight", 0))
    missing = sorted(f"{n}@{s}" for n, s in need - filled)
    if missing:
        raise ValueError(f"EAGLE checkpoint {path}: missing tensors {missing}")
    return layer.to(device=device, dtype=dtype).eval().requires_grad_(False)


def save_tiny_eagle(path: str | Path, target_cfg: ModelConfig, seed: int = 0, scale: float = 0.2) -> Path:
    """A randomly initialised EAGLE layer for ``target_cfg`` (no trained one exists offline),
    saved in the checkpoint layout above: for tests of the plumbing."""
    from safetensors.torch import save_file

    h, q, kv, i = target_cfg.hidden_size, target_cfg.q_size, target_cfg.kv_size, target_cfg.intermediate_size
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * scale

    tensors = {
        "fc.weight": rnd(h, 2 * h), "fc.bias": rnd(h),
        "layers.0.self_attn.q_proj.weight": rnd(q, h), "layers.0.self_attn.k_proj.weight": rnd(kv, h),
        "layers.0.self_attn.v_proj.weight": rnd(kv, h), "layers.0.self_attn.o_proj.weight": rnd(h, q),
        "layers.0.mlp.gate_proj.weight": rnd(i, h), "layers.0.mlp.up_proj.weight": rnd(i, h),
        "layers.0.mlp.down_proj.weight": rnd(h, i),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
    }
    config = {
        "hidden_size": h, "intermediate_size": i, "num_attention_heads": target_cfg.num_heads,
        "num_key_value_heads": target_cfg.num_kv_heads, "head_dim": target_cfg.head_dim,
        "rms_norm_eps": target_cfg.rms_norm_eps, "rope_theta": target_cfg.rope_theta,
        "max_position_embeddings": target_cfg.max_position_embeddings, "vocab_size": target_cfg.vocab_size,
        "num_hidden_layers": 1, "model_type": "llama",
    }
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


CATCH_UP_CHUNK = 256  # positions per catch-up forward: bounds the dense [n, P + n] scores


class EagleProposer:
    # Sequences draft one after another (each has its own dense KV): a step's drafting time
    # grows with the sum of the k's, not their maximum.
    batched = False
    # The target's final-normed features of every position whose input is final.
    target_states = TargetStates("final")

    def __init__(self, layer: EagleLayer, target, draft_cost: float) -> None:
        self.layer = layer
        self.target = target  # LlamaForCausalLM: its embedding, RoPE and LM head
        self.draft_cost = draft_cost
        # seq id -> [(first position, [n, hidden] features)] received since its last proposal
        self.features: dict[str, list[tuple[int, torch.Tensor]]] = {}
        cfg = layer.cfg
        self.device = layer.fc.weight.device
        self.attn = _DenseAttention(cfg.num_heads, cfg.num_kv_heads)
        self._seqs: dict[str, _SeqState] = {}

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pass  # the draft layer's KV is per sequence, not in the paged pool

    def observe_target(self, seq_id: str, first_position: int, states: torch.Tensor) -> None:
        self.features.setdefault(seq_id, []).append((first_position, states))

    def forget(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)
        self.features.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [Proposal(self._draft(r)) for r in requests]

    def _state(self, r: DraftRequest) -> _SeqState:
        seq = r.seq
        st = self._seqs.get(seq.seq_id)
        if st is None or st.preemptions != seq.num_preemptions:
            st = self._seqs[seq.seq_id] = _SeqState(preemptions=seq.num_preemptions)
        st.feats.extend(self.features.pop(seq.seq_id, []))
        return st

    def _draft(self, r: DraftRequest) -> list[int]:
        seq = r.seq
        st = self._state(r)
        t = seq.num_tokens - 1  # the last token's position: its input feature is f(t - 1)
        feat_of = {first + j: rows[j] for first, rows in st.feats for j in range(rows.shape[0])}
        st.feats = []  # consumed: later positions need later features only
        if t - 1 not in feat_of:  # e.g. the first token came from a prefill node
            return []
        lo = t - 1  # the contiguous run of known features ending at f(t - 1) starts at lo
        while lo - 1 in feat_of:
            lo -= 1
        if st.k is None or not lo + 1 <= st.end <= t:
            st.k = st.v = None  # no cache yet, or a gap: the context starts after the gap
            st.start = lo + 1
        # Positions whose draft KV is built now, t last, in chunks (a long local prompt).
        for c in range(st.end, t + 1, CATCH_UP_CHUNK):
            todo = range(c, min(c + CATCH_UP_CHUNK, t + 1))
            toks = torch.tensor([seq.token_ids[p] for p in todo], dtype=torch.long, device=self.device)
            feats = torch.stack([feat_of[p - 1] for p in todo])  # [n, H]
            last_g = self._run(st, toks, feats, todo[0], keep=True)[-1:]  # [1, H]: g(t) at the end
        saved = (st.k, st.v)
        drafts: list[int] = []
        for j in range(r.k):
            tok = int(self.target.compute_logits(last_g).argmax(dim=-1))
            drafts.append(tok)
            if j + 1 < r.k:
                last_g = self._run(st, torch.tensor([tok], device=self.device), last_g, t + 1 + j, keep=True)
        st.k, st.v = saved  # draft positions' KV is dropped: their tokens are not verified yet
        return drafts

    def _run(self, st: _SeqState, toks: torch.Tensor, feats: torch.Tensor, first: int, keep: bool) -> torch.Tensor:
        dtype = next(self.layer.parameters()).dtype
        n = toks.shape[0]
        pos = torch.arange(first, first + n, device=self.device)
        cos, sin = self.target.rope(pos, first + n, dtype)
        emb = self.target.embed_tokens(toks).to(dtype)
        self.attn.past_k, self.attn.past_v = st.k, st.v
        out = self.layer(emb, feats.to(dtype), cos, sin, self.attn)  # [n, H]
        if keep:
            st.k = self.attn.new_k if st.k is None else torch.cat((st.k, self.attn.new_k))
            st.v = self.attn.new_v if st.v is None else torch.cat((st.v, self.attn.new_v))
        return out


def from_engine(engine) -> EagleProposer:
    cfg = engine.config.speculative
    if not cfg.draft_model:
        raise ValueError("speculative method 'eagle' needs draft_model: the EAGLE layer's checkpoint directory")
    layer = load_eagle(cfg.draft_model, engine.model_config, engine.dtype, engine.device)
    # Each draft token runs one decoder layer and the target's LM head; on a small model the head
    # dominates. 0.15 of a decode step is the prior until draft rounds are timed.
    return EagleProposer(layer, engine.loaded.model, draft_cost=0.15)
