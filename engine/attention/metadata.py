"""The one description of a step's batch that every attention backend reads.

A step runs S sequences with T new tokens in total, flattened into one token axis::

    seq s:  |<------ context_lens[s] ------>|<-- q_lens[s] -->|
            | KV already in the paged cache  | new tokens      |
            0                                                  seq_lens[s]

New token i of sequence s sits at absolute position ``context_lens[s] + i`` and attends to
KV positions ``0 .. context_lens[s] + i`` (causal within the new tokens). The same rule covers
a whole prefill (context 0), a prefill chunk or a prefix-cache hit (context > 0), a decode
(q_len 1) and speculative verification (q_len k+1). Backends write the new K/V at
``slot_mapping`` before attending, so a query sees its own token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    q_lens: list[int]  # [S] host copy, new tokens per sequence
    seq_lens: list[int]  # [S] host copy, context + new
    block_size: int
    query_start: list[int]  # [S + 1] host, cumulative q_lens: sequence s's tokens start here
    block_tables: torch.Tensor  # [S, max_blocks] int32, rows padded with 0 past their length
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset of each new token

    @staticmethod
    def build(
        q_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Build from plain lists (the scheduler's view); the one place lists become tensors."""
        slots: list[int] = []
        for q, s, table in zip(q_lens, seq_lens, block_tables):
            for pos in range(s - q, s):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=1) or 1
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        return AttentionMetadata(
            q_lens=list(q_lens),
            seq_lens=list(seq_lens),
            block_size=block_size,
            query_start=qsl,
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        )
