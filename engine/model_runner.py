"""The tensor boundary: scheduler output (plain lists) in, sampled tokens out.

This is the only engine module that turns the scheduler's bookkeeping into tensors: it builds
the flattened token batch and the attention metadata, applies copy-on-write block copies,
runs the model over the paged KV cache and samples the sequences whose slice reached their
last token.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Callable

import torch

from engine.attention.kv_cache import copy_blocks
from engine.attention.metadata import AttentionMetadata
from engine.sampler import Sampler, SamplingRow
from engine.scheduler import SampledTokens, SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,  # [L, num_blocks, 2, block_size, H_kv, D]
        backend,
        block_size: int,
        device: torch.device,
        sampler: Sampler,
        logits_hook: Callable[[list[str], torch.Tensor], None] | None = None,
    ) -> None:
        self.model = model
        # Benchmarks and debugging tools observe raw logits here (seq ids, [S_sample, V] fp32).
        self.logits_hook = logits_hook
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sampler = sampler

    def _generator(self, seed: int | None, index: int, step: int) -> torch.Generator | None:
        """A seeded sample's generator for its ``step``-th output token.

        Derived from (seed, sample index, step) rather than carried along, so a seeded request
        draws the same tokens whatever shares its batch, after a preemption, and when its first
        token was sampled on a prefill node and the rest on a decode node.
        """
        if seed is None:
            return None
        digest = hashlib.blake2b(struct.pack("<qqq", seed, index, step), digest_size=8).digest()
        return torch.Generator(device=self.device).manual_seed(int.from_bytes(digest, "little") >> 1)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, block_table_of: Callable[[str], list[int]]
    ) -> dict[str, SampledTokens]:
        if out.block_copies:
            copy_blocks(self.kv_cache, out.block_copies)

        input_ids: list[int] = []
        positions: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []  # index into the flattened tokens of each sampled slice end
        for item in out.scheduled:
            end = item.start + item.num_new_tokens
            input_ids.extend(item.seq.token_ids[item.start : end])
            positions.extend(range(item.start, end))
            q_lens.append(item.num_new_tokens)
            seq_lens.append(end)
            tables.append(block_table_of(item.seq.seq_id))
            if item.sample:
                sample_rows.append(len(input_ids) - 1)

        meta = AttentionMetadata.build(q_lens, seq_lens, tables, self.block_size, self.device)
        self.backend.begin_step(meta)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)  # [T]
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        hidden = self.model(ids_t, pos_t, self.kv_cache, self.backend)  # [T, hidden]
        if not sample_rows:
            return {}
        idx = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, idx))  # [S_sample, V] fp32
        if self.logits_hook is not None:
            self.logits_hook([it.seq.seq_id for it in out.scheduled if it.sample], logits)

        rows: list[SamplingRow] = []
        src: list[int] = []  # logits row feeding each sampling row (n > 1 repeats it)
        owners: list[tuple[str, int]] = []
        r = 0
        for item in out.scheduled:
            if not item.sample:
                continue
            seq = item.seq
            p = seq.params
            prompt = seq.prompt_token_ids if p.repetition_penalty != 1.0 else ()
            output = seq.output_token_ids
            for k in range(item.num_samples):
                index = seq.index + k
                rows.append(
                    SamplingRow(
                        params=p,
                        prompt_token_ids=prompt,
                        output_token_ids=output,
                        generator=self._generator(p.seed, index, len(output)),
                    )
                )
                src.append(r)
                owners.append((seq.seq_id, k))
            r += 1
        if len(src) != logits.shape[0]:
            logits = logits.index_select(0, torch.tensor(src, dtype=torch.long, device=self.device))
        res = self.sampler(logits, rows)

        results: dict[str, SampledTokens] = {}
        for i, (seq_id, _) in enumerate(owners):
            st = results.setdefault(seq_id, SampledTokens(token_ids=[], logprobs=None, top_logprobs=None))
            st.token_ids.append(res.token_ids[i])
            if res.logprobs is not None:
                st.logprobs = (st.logprobs or []) + [res.logprobs[i]]
            if res.top_logprobs is not None:
                st.top_logprobs = (st.top_logprobs or []) + [res.top_logprobs[i]]
        return results
