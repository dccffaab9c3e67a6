"""Medusa heads: extra heads on the target's last hidden state, head j guessing the token j + 2
positions ahead (the target's own head gives the next one). Loaded from a local checkpoint
directory::

    heads_dir/config.json        {"num_heads": K, "hidden_size": H, "vocab_size": V, "num_layers": 1}
    heads_dir/model.safetensors  heads.{j}.blocks.{i}.weight [H, H], .bias [H]; heads.{j}.lm_head.weight [V, H]

Each head is ``lm_head(x + sum of SiLU residual blocks)``. Drafts are the heads' argmaxes (a
deterministic proposal: q is one-hot, so verification stays exact for any temperature). The
hidden state comes from the model runner: the proposer declares ``TargetStates("last")`` and
receives the final-normed state of the position that produced each sequence's newest token;
a sequence without one yet (its first token came from a prefill node) drafts nothing for one
step.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from engine.speculative.proposer import DraftRequest, Proposal, TargetStates


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H]
        return x + torch.nn.functional.silu(self.linear(x))


class MedusaHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, num_layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(hidden) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int, vocab_size: int, num_layers: int = 1) -> None:
        super().__init__()
        self.config = dict(num_heads=num_heads, hidden_size=hidden_size, vocab_size=vocab_size, num_layers=num_layers)
        self.heads = nn.ModuleList(MedusaHead(hidden_size, vocab_size, num_layers) for _ in range(num_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, K, V]
        return torch.stack([h(hidden) for h in self.heads], dim=1)


def save_heads(heads: MedusaHeads, path: str | Path) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(heads.config))
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(path / "model.safetensors"))
    return path


def save_tiny_heads(path: str | Path, hidden_size: int, vocab_size: int, num_heads: int = 3, seed: int = 0) -> Path:
    """Randomly initialised heads (no trained heads exist offline): for tests of the plumbing."""
    torch.manual_seed(seed)
    return save_heads(MedusaHeads(num_heads, hidden_size, vocab_size), path)


def load_heads(path: str | Path, dtype: torch.dtype, device: torch.device) -> MedusaHeads:
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    heads = MedusaHeads(int(cfg["num_heads"]), int(cfg["hidden_size"]), int(cfg["vocab_size"]),
                        int(cfg.get("num_layers", 1)))
    heads.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


class MedusaProposer:
    batched = True  # one drafting round covers every sequence of the step
    target_states = TargetStates("last")

    def __init__(self, heads: MedusaHeads, draft_cost: float) -> None:
        self.heads = heads
        self.draft_cost = draft_cost
        self.last_hidden: dict[str, torch.Tensor] = {}  # seq id -> [hidden], from observe_target

    def observe_target(self, seq_id: str, first_position: int, states: torch.Tensor) -> None:
        self.last_hidden[seq_id] = states[-1]  # [hidden]

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        have = [i for i, r in enumerate(requests) if r.seq.seq_id in self.last_hidden]
        out = [Proposal([]) for _ in requests]
        if not have:
            return out
        h = torch.stack([self.last_hidden[requests[i].seq.seq_id] for i in have])  # [N, H]
        guesses = self.heads(h.to(next(self.heads.parameters()).dtype)).argmax(dim=-1).tolist()  # [N, K]
        for row, i in enumerate(have):
            out[i] = Proposal(guesses[row][: requests[i].k])
        return out

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pass  # no KV

    def forget(self, seq_id: str) -> None:
        self.last_hidden.pop(seq_id, None)


def from_engine(engine) -> MedusaProposer:
    cfg = engine.config.speculative
    if not cfg.draft_model:
        raise ValueError("speculative method 'medusa' needs draft_model: the heads' checkpoint directory")
    heads = load_heads(cfg.draft_model, engine.dtype, engine.device)
    mc = engine.model_config
    if heads.config["hidden_size"] != mc.hidden_size or heads.config["vocab_size"] != mc.vocab_size:
        raise ValueError(f"Medusa heads are for hidden {heads.config['hidden_size']} / vocab "
                         f"{heads.config['vocab_size']}, the model has {mc.hidden_size} / {mc.vocab_size}")
    # One head is a hidden x vocab matmul, like the target's own head: small next to the layers.
    return MedusaProposer(heads, draft_cost=0.02)
