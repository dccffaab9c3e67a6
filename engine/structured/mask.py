"""The token bitmask at the tensor boundary: one int32 word per 32 tokens, bit ``t % 32`` of
word ``t // 32`` set when token ``t`` is allowed (the layout llguidance and xgrammar share).

``StepMasks`` carries one step's masks from the engine (which fills them from the matchers,
engine/structured/decoding.py) to the model runner, which applies them to the logits rows
before the sampler and the verification see them::

    logits rows   | sampled items, in order (1 row each) | verified items, in order (k + 1 rows each) |
    mask rows       only for constrained sequences; a row left out is not masked
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine.scheduler import ScheduledSeq

_BITS = torch.arange(32, dtype=torch.int32)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[batch, words] int32 -> [batch, vocab_size] bool."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1  # [batch, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place. logits: [batch, vocab];
    bitmask: [batch, words] on the logits' device. Tokens past the bitmask's 32 * words (a
    model whose vocab is padded past the mask) are disallowed."""
    vocab = logits.shape[-1]
    covered = min(vocab, bitmask.shape[-1] * 32)
    allowed = allowed_tokens(bitmask, covered)  # [batch, covered]
    logits[:, :covered].masked_fill_(~allowed, float("-inf"))
    if covered < vocab:
        logits[:, covered:] = float("-inf")


@dataclass(slots=True)
class StepMasks:
    """One step's masks: ``rows`` [R, words] int32 (CPU), and per constrained sequence the
    first of its rows (a sampled item has one row, a verified one k + 1). ``pending``: a fill
    of some rows still running beside the forward (engine/structured/decoding.py FillMode);
    ``apply`` waits for it."""

    rows: torch.Tensor
    first_row: dict[str, int] = field(default_factory=dict)
    pending: Future | None = None

    def wait(self) -> None:
        """Until every row is filled (re-raises the fill's error)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def apply(self, logits: torch.Tensor, sampled: list[ScheduledSeq], verifying: list[ScheduledSeq]) -> None:
        """Mask ``logits`` [S + R, V] in place: ``sampled`` items own its first S rows and
        ``verifying`` items the rest, k + 1 each (the model runner's order)."""
        self.wait()
        at, src = [], []  # logits row, mask row
        row = 0
        for item in sampled:
            first = self.first_row.get(item.seq.seq_id)
            if first is not None:
                at.append(row)
                src.append(first)
            row += 1
        for item in verifying:
            n = len(item.draft_token_ids) + 1
            first = self.first_row.get(item.seq.seq_id)
            if first is not None:
                at.extend(range(row, row + n))
                src.extend(range(first, first + n))
            row += n
        if not at:
            return
        idx = torch.tensor(at, dtype=torch.long, device=logits.device)
        masks = self.rows.index_select(0, torch.tensor(src, dtype=torch.long)).to(logits.device)  # [M, words]
        part = logits.index_select(0, idx)  # [M, V]
        apply_bitmask(part, masks)
        logits.index_copy_(0, idx, part)
