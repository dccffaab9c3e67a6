"""The tensor boundary: scheduler output (plain lists) in, sampled tokens out.

This is the only engine module that turns the scheduler's bookkeeping into tensors: it builds
the flattened token batch and the attention metadata, applies copy-on-write block copies,
runs the model over the paged KV cache and samples the sequences whose slice reached their
last token.

Speculative verification: a scheduled sequence carrying draft tokens runs its last token and
the drafts as one query of length k + 1; the logits of all k + 1 positions go through the
sampler's exact processing (penalties see the drafts before each position as output) and
``verify_drafts`` picks the emitted run.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.attention.kv_cache import copy_blocks
from engine.attention.metadata import AttentionMetadata
from engine.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    exponential_noise,
    exponential_race,
    probs_from_penalized,
)
from engine.scheduler import SampledTokens, ScheduledSeq, SchedulerOutput
from engine.speculative.proposer import TargetStates
from engine.speculative.rejection_sampler import verify_by_target_samples, verify_drafts
from engine.structured.mask import StepMasks

# (seq id, first position, [n, hidden] states): how a proposer receives target states
StateSink = Callable[[str, int, torch.Tensor], None]

# Layer-wise KV streaming (prefill role): ``listener(request_id, layer, ready_blocks, table)``
# after decoder layer ``layer`` of a step ran: the request's blocks [0, ready_blocks), ids
# ``table[:ready_blocks]``, now hold final KV for that layer (and every earlier layer). Called
# on the engine thread, per layer, for requests added with ``stream_kv`` only; it must be quick
# (hand the news to another thread). ``layer == KV_PREEMPTED``: the request was preempted, its
# blocks went back to the pool and everything said about it before is void.
KVLayerListener = Callable[[str, int, int, tuple[int, ...]], None]
KV_PREEMPTED = -1


def final_blocks(start: int, num_new_tokens: int, sample: bool, block_size: int) -> int:
    """Blocks of a sequence whose KV is final once a step computed positions up to
    ``start + num_new_tokens``: the full ones, and the partial last one too at the step that
    samples (the prompt's end: a prefill-role request ends there, nothing more is written)."""
    end = start + num_new_tokens
    return -(-end // block_size) if sample else end // block_size


def seeded_generator(device: torch.device, *key: int, person: bytes = b"") -> torch.Generator:
    """A generator seeded from a tuple of ints (a request's seed plus positions), the same in
    every process: what makes seeded sampling independent of batching and of which node runs
    which step."""
    digest = hashlib.blake2b(struct.pack(f"<{len(key)}q", *key), digest_size=8, person=person).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)


@dataclass(slots=True)
class StepBatch:
    """One step's scheduled slices flattened onto one token axis (T tokens), as plain lists;
    ``_run_model`` makes them tensors.

    A verifying sequence queries its last token and its k drafts::

        item:         a (prompt, samples)   b (decode)   c (verifies 3 drafts)
        flat row:     0  1  2  3  4         5            6  7  8  9
        input_ids:    p0 p1 p2 p3 p4        t            t  d1 d2 d3
        flat_starts:  0                     5            6
        sample_rows:              4         5
        verify_rows:                                     6
    """

    input_ids: list[int] = field(default_factory=list)  # [T]
    positions: list[int] = field(default_factory=list)  # [T]
    q_lens: list[int] = field(default_factory=list)  # per scheduled item: its tokens this step
    seq_lens: list[int] = field(default_factory=list)  # per scheduled item: KV length after the step
    tables: list[list[int]] = field(default_factory=list)  # per scheduled item: its block table
    flat_starts: list[int] = field(default_factory=list)  # flat index of each item's first token
    sample_rows: list[int] = field(default_factory=list)  # flat index of each sampled slice end
    verify_rows: list[int] = field(default_factory=list)  # flat index of the first of a verification's k + 1 rows
    verifying: list[ScheduledSeq] = field(default_factory=list)  # the items verify_rows belong to


def prepare_batch(scheduled: list[ScheduledSeq], block_table_of: Callable[[str], list[int]]) -> StepBatch:
    """Flatten the scheduled slices (plus any drafts) into one token axis."""
    b = StepBatch()
    for item in scheduled:
        b.flat_starts.append(len(b.input_ids))
        end = item.start + item.num_new_tokens
        drafts = item.draft_token_ids
        b.input_ids.extend(item.seq.token_ids[item.start : end])
        b.input_ids.extend(drafts)
        b.positions.extend(range(item.start, end + len(drafts)))
        b.q_lens.append(item.num_new_tokens + len(drafts))
        b.seq_lens.append(end + len(drafts))
        b.tables.append(block_table_of(item.seq.seq_id))
        if drafts:
            b.verifying.append(item)
            b.verify_rows.append(len(b.input_ids) - len(drafts) - 1)
        elif item.sample:
            b.sample_rows.append(len(b.input_ids) - 1)
    return b


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
        self._states: TargetStates | None = None  # what a proposer asked for (send_target_states)
        self._state_sink: StateSink | None = None
        self.kv_layer_listener: KVLayerListener | None = None  # see KVLayerListener
        # The KV tiers' tensors (engine/kv_tiers/build.py TierCopies), None without tiers.
        self.tier_copies = None

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks brought back from the host tier into the pool: ``(host slot, block id)``
        pairs (KVCacheManager.take_swap_ins), before the forward pass that reads them."""
        if pairs:
            self.tier_copies.copy_in(pairs)

    def send_target_states(self, states: TargetStates, sink: StateSink) -> None:
        """After every step, hand ``sink`` the target states a proposer declared it needs."""
        if states.positions not in ("last", "final"):
            raise ValueError(f"TargetStates.positions must be 'last' or 'final', got {states.positions!r}")
        self._states, self._state_sink = states, sink

    def _layer_hook(self, out: SchedulerOutput, tables: list[list[int]]) -> Callable[[int], None] | None:
        """The per-layer callback for this step's streaming requests; None (no per-layer work
        at all) when none streams."""
        listener = self.kv_layer_listener
        if listener is None:
            return None
        ready = [(item.seq.request_id, n, tuple(table[:n]))
                 for item, table in zip(out.scheduled, tables) if item.seq.stream_kv
                 for n in (final_blocks(item.start, item.num_new_tokens, item.sample, self.block_size),)]
        if not ready:
            return None
        # On CPU torch ran layer i's K/V write before returning, so the blocks are in memory when
        # the listener hears of them. On CUDA the write is only enqueued: a reader on another
        # thread must wait on an event recorded after layer i (one per layer, and a copy stream
        # for the gather) before it reads; that GPU path is not built (docs/cluster.md).

        def after_layer(layer: int) -> None:
            for rid, n, table in ready:
                listener(rid, layer, n, table)

        return after_layer

    def _generator(self, seed: int | None, index: int, step: int) -> torch.Generator | None:
        """A seeded sample's generator for its ``step``-th output token.

        Derived from (seed, sample index, step) rather than carried along, so a seeded request
        draws the same tokens whatever shares its batch, after a preemption, and when its first
        token was sampled on a prefill node and the rest on a decode node.
        """
        if seed is None:
            return None
        return seeded_generator(self.device, seed, index, step)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, block_table_of: Callable[[str], list[int]], masks: StepMasks | None = None
    ) -> dict[str, SampledTokens]:
        """One step: prepare the batch, run the model, then verify and sample. ``masks``:
        constrained sequences' token bitmasks, applied to their logits rows before anything
        reads them (engine/structured/), so sampling, verification and logprobs all see the
        masked distribution."""
        if out.block_copies:
            copy_blocks(self.kv_cache, out.block_copies)
        batch = prepare_batch(out.scheduled, block_table_of)
        hidden, states = self._run_model(out, batch)  # [T, hidden], [T, hidden]
        if not batch.sample_rows and not batch.verifying:
            return {}  # prefill chunks that end short of their prompt's last token
        # Every row that needs logits, sampled and verified, through the LM head at once: the
        # head is the largest matrix, and a second pass would read it twice in mixed steps.
        verified = [first + j for item, first in zip(batch.verifying, batch.verify_rows)
                    for j in range(len(item.draft_token_ids) + 1)]
        idx = torch.tensor(batch.sample_rows + verified, dtype=torch.long, device=self.device)  # [S + R]
        all_logits = self.model.compute_logits(hidden.index_select(0, idx))  # [S + R, V] fp32
        if masks is not None:
            masks.apply(all_logits, [it for it in out.scheduled if it.sample and not it.draft_token_ids],
                        batch.verifying)
        num_sampled = len(batch.sample_rows)
        results: dict[str, SampledTokens] = {}
        # Verify, then sample: unseeded draws of both come from one default generator.
        if batch.verifying:
            results.update(self._verify(batch.verifying, batch.verify_rows, states, all_logits[num_sampled:]))
        if num_sampled:
            results.update(self._sample(out.scheduled, batch.sample_rows, states, all_logits[:num_sampled]))
        return results

    def _run_model(self, out: SchedulerOutput, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass over the paged cache. -> (hidden [T, hidden], states [T, hidden]):
        the final hidden states, and what a proposer reads (the layer it asked for, else the
        same final states), sent to it here when it wants every position."""
        meta = AttentionMetadata.build(batch.q_lens, batch.seq_lens, batch.tables, self.block_size, self.device)
        self.backend.begin_step(meta)
        ids_t = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)  # [T]
        pos_t = torch.tensor(batch.positions, dtype=torch.long, device=self.device)  # [T]
        want = self._states
        hidden, layer_states = self.model.forward_states(  # [T, hidden], [T, hidden] | None
            ids_t, pos_t, self.kv_cache, self.backend, capture_layer=want.layer if want is not None else None,
            after_layer=self._layer_hook(out, batch.tables))
        states = layer_states if layer_states is not None else hidden  # [T, hidden]
        if want is not None and want.positions == "final":
            for item, first in zip(out.scheduled, batch.flat_starts):
                if not item.draft_token_ids:  # a verification sends its accepted run in _verify
                    self._state_sink(item.seq.seq_id, item.start,
                                     states[first : first + item.num_new_tokens].clone())  # [n, hidden]
        return hidden, states

    def _sample(
        self,
        scheduled: list[ScheduledSeq],
        sample_rows: list[int],  # flat row of each sampling item's last token
        states: torch.Tensor,  # [T, hidden]: what a proposer reads (see send_target_states)
        logits: torch.Tensor,  # [S, V] fp32: one row per sampling item, in order
    ) -> dict[str, SampledTokens]:
        """Sample the next token of every sequence whose slice reached its last token (not the
        verifications); an n > 1 prompt's row is sampled n times."""
        if self.logits_hook is not None:
            self.logits_hook([it.seq.seq_id for it in scheduled if it.sample], logits)
        items = [it for it in scheduled if it.sample and not it.draft_token_ids]  # one per logits row
        rows: list[SamplingRow] = []
        src: list[int] = []  # logits row feeding each sampling row (n > 1 repeats it)
        owners: list[str] = []  # seq id of each sampling row
        for r, item in enumerate(items):
            seq, p = item.seq, item.seq.params
            prompt = seq.prompt_token_ids if p.repetition_penalty != 1.0 else ()
            output = seq.output_token_ids
            for k in range(item.num_samples):
                rows.append(SamplingRow(params=p, prompt_token_ids=prompt, output_token_ids=output,
                                        generator=self._generator(p.seed, seq.index + k, len(output))))
                src.append(r)
                owners.append(seq.seq_id)
        if len(src) != logits.shape[0]:
            logits = logits.index_select(0, torch.tensor(src, dtype=torch.long, device=self.device))  # [N, V]
        res = self.sampler(logits, rows)
        want = self._states
        if want is not None and want.positions == "last":
            for item, row in zip(items, sample_rows):
                last = item.start + item.num_new_tokens - 1  # the position that produced the new token
                self._state_sink(item.seq.seq_id, last, states[row : row + 1].clone())  # [1, hidden]
        results: dict[str, SampledTokens] = {}
        for i, seq_id in enumerate(owners):
            st = results.setdefault(seq_id, SampledTokens(token_ids=[], logprobs=None, top_logprobs=None))
            st.token_ids.append(res.token_ids[i])
            if res.logprobs is not None:
                st.logprobs = (st.logprobs or []) + [res.logprobs[i]]
            if res.top_logprobs is not None:
                st.top_logprobs = (st.top_logprobs or []) + [res.top_logprobs[i]]
        return results

    def _verify(
        self,
        items: list[ScheduledSeq],
        first_rows: list[int],
        states: torch.Tensor,  # [T, hidden]: what a proposer reads (see send_target_states)
        logits: torch.Tensor,  # [R, V] fp32: every verified position, sequence by sequence
    ) -> dict[str, SampledTokens]:
        """Verify every speculating sequence's k + 1 positions."""
        rows: list[SamplingRow] = []
        for item, first in zip(items, first_rows):
            seq, p = item.seq, item.seq.params
            prompt = seq.prompt_token_ids if p.repetition_penalty != 1.0 else ()
            output = seq.output_token_ids
            for j in range(len(item.draft_token_ids) + 1):
                # Position j comes after drafts d_1 .. d_j: penalties and min_tokens see them.
                rows.append(SamplingRow(params=p, prompt_token_ids=prompt,
                                        output_token_ids=output + item.draft_token_ids[:j]))
        if self.logits_hook is not None:
            self.logits_hook([it.seq.seq_id for it in items for _ in range(len(it.draft_token_ids) + 1)], logits)
        penalized = apply_penalties(logits, rows, self.sampler.eos_token_ids)  # [R, V]
        # Greedy verification reads only the argmax, which the one-hot probabilities put where
        # the penalized logits have it: skip a softmax pass over [R, V] (about 2-6 ms per
        # verifying step at batch 8 on CPU).
        all_greedy = all(it.seq.params.greedy and it.draft_probs is None for it in items)
        probs = penalized if all_greedy else probs_from_penalized(penalized, rows)  # [R, V]

        results: dict[str, SampledTokens] = {}
        r = 0
        for item, first in zip(items, first_rows):
            seq, p = item.seq, item.seq.params
            k = len(item.draft_token_ids)
            step = len(seq.output_token_ids)
            if item.draft_probs is None and not p.greedy:
                # One-hot drafts: emit the target's own samples (what plain decoding would
                # draw at these steps) and accept the drafts they agree with.
                own = self._target_samples(probs[r : r + k + 1], p.seed, seq.index, step)
                n_acc, nxt = verify_by_target_samples(item.draft_token_ids, own)
            else:
                uniform = self._uniforms(p.seed, seq.index, step, k + 1)  # [2, k + 1]
                draft_probs = None if item.draft_probs is None else item.draft_probs.to(probs.device)
                n_acc, nxt = verify_drafts(item.draft_token_ids, probs[r : r + k + 1], draft_probs, uniform,
                                           p.greedy)
            emitted = item.draft_token_ids[:n_acc] + [nxt]
            st = SampledTokens(token_ids=emitted)
            if p.logprobs is not None:
                tok = torch.tensor(emitted, dtype=torch.long, device=self.device)
                lp, top = Sampler._logprobs(penalized[r : r + n_acc + 1], tok, rows[r : r + n_acc + 1])
                st.logprobs, st.top_logprobs = lp, (top if p.logprobs else None)
            results[seq.seq_id] = st
            want = self._states
            if want is not None and want.positions == "last":  # the emitted token came from start + n_acc
                self._state_sink(seq.seq_id, item.start + n_acc, states[first + n_acc : first + n_acc + 1].clone())
            elif want is not None:  # positions start .. start + n_acc had accepted inputs
                self._state_sink(seq.seq_id, item.start, states[first : first + n_acc + 1].clone())
            r += k + 1
        return results

    def _target_samples(self, probs: torch.Tensor, seed: int | None, index: int, step: int) -> list[int]:
        """One token per row of ``probs`` [n, V], drawn as the plain sampler draws output
        token ``step + j``: an exponential race, a seeded request's noise from the generator of
        that step (the very draw plain decoding makes from the same p), an unseeded one's from
        the shared default generator (the same distribution, not the same draw)."""
        gens = [self._generator(seed, index, step + j) for j in range(probs.shape[0])]
        noise = exponential_noise(probs, gens, self.sampler.default_generator(probs.device))  # [n, V]
        return exponential_race(probs, noise).tolist()

    def _uniforms(self, seed: int | None, index: int, step: int, n: int) -> torch.Tensor:  # [2, n]
        """Uniforms for a verification of n positions, the first emitting output token ``step``.

        A seeded request draws position j's pair from the generator of output token step + j,
        so its tokens depend on its seed and drafts only, never on the batch.
        """
        if seed is None:
            return torch.rand((2, n), generator=self.sampler.default_generator(self.device), device=self.device)
        cols = [torch.rand(2, generator=self._generator(seed, index, step + j), device=self.device)
                for j in range(n)]
        return torch.stack(cols, dim=1)
