"""A step's inputs as two int64 tensors, broadcast from rank 0 to the workers (no pickle).

Header ``[op, T, S, W, C]``, then (for a step) one payload of
``2T + 2S + S*W + 2C`` int64: token ids [T], positions [T], q_lens [S], seq_lens [S], block
tables [S, W] (rows padded with 0, as AttentionMetadata pads them), copy-on-write pairs [C, 2].
A worker rebuilds the same AttentionMetadata from them that rank 0 built, so every rank writes
the same slots of its own KV pool and attends over the same blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

OP_STEP = 1
OP_STOP = 2
HEADER_LEN = 5


@dataclass(frozen=True, slots=True)
class StepInputs:
    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    q_lens: list[int]  # [S]
    seq_lens: list[int]  # [S]
    block_tables: list[list[int]]  # [S][<= W]
    block_copies: list[tuple[int, int]]  # copy-on-write (src, dst) block pairs, before the forward


def pack(step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:  # header [5], payload [n] int64
    t, s = len(step.input_ids), len(step.q_lens)
    w = max((len(b) for b in step.block_tables), default=1) or 1
    tables = [x for b in step.block_tables for x in (list(b) + [0] * (w - len(b)))]
    copies = [x for pair in step.block_copies for x in pair]
    flat = step.input_ids + step.positions + step.q_lens + step.seq_lens + tables + copies
    header = torch.tensor([OP_STEP, t, s, w, len(step.block_copies)], dtype=torch.int64)
    return header, torch.tensor(flat, dtype=torch.int64)


def payload_len(header: torch.Tensor) -> int:
    _, t, s, w, c = (int(x) for x in header.tolist())
    return 2 * t + 2 * s + s * w + 2 * c


def unpack(header: torch.Tensor, payload: torch.Tensor) -> StepInputs:
    _, t, s, w, c = (int(x) for x in header.tolist())
    v = payload.tolist()
    cuts, at = [], 0
    for n in (t, t, s, s, s * w, 2 * c):
        cuts.append(v[at : at + n])
        at += n
    ids, pos, q_lens, seq_lens, tables, copies = cuts
    return StepInputs(input_ids=ids, positions=pos, q_lens=q_lens, seq_lens=seq_lens,
                      block_tables=[tables[i * w : (i + 1) * w] for i in range(s)],
                      block_copies=[(copies[2 * i], copies[2 * i + 1]) for i in range(c)])


def stop_header() -> torch.Tensor:  # [5] int64
    return torch.tensor([OP_STOP, 0, 0, 0, 0], dtype=torch.int64)


def broadcast(group, t: torch.Tensor, timeout: timedelta) -> None:
    """Rank 0's ``t`` into every rank's ``t`` (same shape and dtype), within ``timeout``."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = timeout
    group.broadcast([t], opts).wait()
