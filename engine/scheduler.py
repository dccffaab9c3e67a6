"""Iteration-level scheduler: continuous batching over a paged KV cache (plain data, no torch).

Every step the scheduler hands the model runner a token budget's worth of work:

1. Running sequences first, oldest first. Each gets the slice of tokens whose KV is missing
   (one token for a decode, a chunk for an unfinished prefill). When the pool cannot hold
   that slice, the newest running sequence is preempted by recompute: its blocks go back to
   the pool (they stay in the prefix cache until evicted) and it returns to the front of the
   waiting queue.
2. Then, if nobody was preempted this step, waiting sequences in arrival order. A prefix-cache
   hit skips the cached tokens; the rest is prefilled in chunks that fit the remaining budget
   (chunked prefill). A new sequence is only admitted while the pool keeps ``watermark`` of
   its blocks free afterwards, so running sequences can grow without thrashing.

After the model ran, ``update_from_output`` advances ``num_computed_tokens``, registers the
blocks that became full of computed tokens in the prefix cache, appends sampled tokens, forks
n > 1 requests after their prompt, and finishes sequences that hit a stop condition.

Speculative decoding: a decoding sequence given a lookahead k gets slots for its last token and
k draft tokens (``allocate_slots(total = computed + 1 + k)``)::

    positions  | computed ............ | t | d1 .. dk |
                                       ^ slots for the verification of t and k drafts

After verification only the accepted run counts: its tokens are appended one by one with the
stop checks (a stop cuts the run), ``num_computed_tokens`` advances over verified tokens only,
the KV of the rejected positions is truncated away, and only then are full blocks hashed.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable
from typing import Sequence as Seq

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheManager, PrefixHit
from engine.sequence import Sequence, SequenceStatus, seq_id_of
from tokens.stop import FinishReason, stop_reason


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (== num_computed_tokens when scheduled)
    num_new_tokens: int  # query length this step
    sample: bool  # the slice reaches the last token: the step yields the next token
    num_samples: int = 1  # > 1 on the step that finishes an n > 1 prompt (then it forks)
    # Speculation: slots reserved for up to this many draft tokens after the last token; the
    # engine fills in the proposer's drafts (at most num_lookahead) before the model runs.
    num_lookahead: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: Any = None  # [len(draft_token_ids), V] tensor, or None (one-hot proposals)
    draft_bucket: int | None = None  # the proposal's confidence bucket (engine.speculative.proposer.Proposal)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # (host slot, block): prefix blocks brought back from the host or disk tier, copied in by
    # the model runner before the step's forward pass (KVCacheManager.take_swap_ins)
    swap_ins: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SampledTokens:
    """What the model runner produced for one scheduled sequence that sampled."""

    # One per sample (n on a forking step, else 1); after a verification, the emitted run:
    # the accepted drafts then the recovered or bonus token.
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv: KVCacheManager,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        clock=time.monotonic,
    ) -> None:
        self.config = scheduler_config
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        self.watermark_blocks = int(math.ceil(cache_config.watermark * kv.num_blocks))
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, list[Sequence]] = {}
        self.num_preemptions = 0

    # ------------------------------------------------------------------ admission
    def add_sequence(self, seq: Sequence) -> None:
        """Queue a new request's first sequence. Limits are checked by the engine beforehand."""
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.requests[seq.request_id] = [seq]
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------------ scheduling
    def decode_candidates(self) -> list[Sequence]:
        """Running sequences that are decoding (only their last token lacks KV): the ones that
        may speculate this step."""
        return [s for s in self.running
                if s.num_tokens - s.num_computed_tokens == 1 and not s.needs_fork]

    def schedule(self, lookahead: dict[str, int] | None = None) -> SchedulerOutput:
        """``lookahead``: seq id -> draft tokens to reserve slots for (decoding sequences)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = self.clock()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            k = self._lookahead(seq, n, budget, lookahead)
            scheduled_self = True
            if k and not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens,
                                                seq.num_computed_tokens + n + k):
                k = 0  # speculation never preempts anyone: decode plainly this step
            while not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens,
                                             seq.num_computed_tokens + n + k):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    scheduled_self = False
                    break
            if not scheduled_self:
                break
            item = self._scheduled(seq, n)
            item.num_lookahead = k
            out.scheduled.append(item)
            budget -= n + k
            i += 1

        if not out.preempted:
            budget = self._admit_waiting(out, budget, now)

        out.block_copies = self.kv.take_copies()
        out.swap_ins = self.kv.take_swap_ins()
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float) -> int:
        """Arrival order, with one exception: once a sequence cannot get its blocks, only
        sequences whose KV is already resident (a decode node's prefilled requests: their
        prompt's blocks arrived with them) may pass it. They need a block or so to decode and
        they hold memory until they run; making them wait behind a prompt that waits for memory
        deadlocks a decode node whose blocks they hold (seen under load: nothing running, 32
        waiting, the pool 88% full)."""
        i = 0
        blocked = False
        while i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            if blocked and seq.num_computed_tokens == 0:
                i += 1
                continue
            n_seqs = seq.params.n if seq.needs_fork else 1
            if len(self.running) + n_seqs > self.config.max_num_seqs and self.running:
                break
            hit: PrefixHit | None = None
            computed = seq.num_computed_tokens
            if computed == 0 and self.enable_prefix_caching:
                hit = self.kv.lookup_prefix(seq.token_ids, seq.cache_salt)
                computed = hit.num_tokens
            remaining = seq.num_tokens - computed
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                break
            if not self.kv.allocate_slots(seq.seq_id, computed, computed + n, hit,
                                          reserve_blocks=self.watermark_blocks):
                blocked = True
                i += 1
                continue
            del self.waiting[i]
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                if seq.num_computed_tokens == 0:  # else KV arrived with it (decode role)
                    seq.num_cached_tokens = min(computed, seq.num_prompt_tokens)
            seq.num_computed_tokens = computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(self._scheduled(seq, n))
            budget -= n
        return budget

    def _lookahead(self, seq: Sequence, n: int, budget: int, lookahead: dict[str, int] | None) -> int:
        """Draft slots for ``seq``: what was asked, within the step budget, the tokens the
        request may still produce and the context (the last emitted token needs no slot)."""
        if not lookahead or n != seq.num_tokens - seq.num_computed_tokens or n != 1:
            return 0
        k = lookahead.get(seq.seq_id, 0)
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(k, budget - n, room))

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSeq:
        sample = seq.num_computed_tokens + n == seq.num_tokens
        samples = seq.params.n if (sample and seq.needs_fork) else 1
        return ScheduledSeq(seq, seq.num_computed_tokens, n, sample, samples)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ results
    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, SampledTokens]
    ) -> list[Sequence]:
        """Advance every scheduled sequence; return the sequences that got new tokens or finished."""
        now = self.clock()
        touched: list[Sequence] = []
        for item in out.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            if item.num_lookahead:
                self._update_speculative(item, sampled[seq.seq_id], now)
                touched.append(seq)
                continue
            seq.num_computed_tokens = item.start + item.num_new_tokens
            if self.enable_prefix_caching:
                self.kv.cache_computed_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.cache_salt)
            if not item.sample:
                continue
            result = sampled[seq.seq_id]
            children = self._fork(seq, len(result.token_ids) - 1) if item.num_samples > 1 else []
            for s, tok in zip([seq, *children], result.token_ids):
                s.token_ids.append(tok)
                if s.first_token_time is None:
                    s.first_token_time = now
                self.check_stop(s)
                touched.append(s)
        for seq in touched:
            if seq.is_finished:
                self._release(seq)
        return touched

    def _update_speculative(self, item: ScheduledSeq, result: SampledTokens, now: float) -> None:
        """Append a verification's emitted run, token by token, and roll the KV back to it.

        The last token and the accepted drafts have verified KV; the final emitted token (the
        recovered or bonus one) has none yet, like any freshly sampled token. A stop condition
        met inside the run drops the tokens after it.
        """
        seq = item.seq
        for tok in result.token_ids:
            seq.token_ids.append(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            self.check_stop(seq)
            if seq.is_finished:
                break
        seq.num_computed_tokens = seq.num_tokens - 1
        # Free the slots of rejected (and cut-off) positions before anything is hashed.
        self.kv.truncate(seq.seq_id, seq.num_computed_tokens)
        if self.enable_prefix_caching:
            self.kv.cache_computed_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.cache_salt)

    def _fork(self, parent: Sequence, count: int) -> list[Sequence]:
        parent.forked = True
        children = []
        pos = self.running.index(parent) + 1
        for k in range(1, count + 1):
            child = Sequence(
                request_id=parent.request_id,
                index=k,
                token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens,
                params=parent.params,
                arrival_time=parent.arrival_time,
                num_computed_tokens=parent.num_computed_tokens,
                num_cached_tokens=parent.num_cached_tokens,
                status=SequenceStatus.RUNNING,
                forked=True,
                cache_salt=parent.cache_salt,
                first_scheduled_time=parent.first_scheduled_time,
            )
            self.kv.fork(parent.seq_id, child.seq_id)
            self.running.insert(pos, child)
            pos += 1
            self.requests[parent.request_id].append(child)
            children.append(child)
        return children

    def check_stop(self, seq: Sequence) -> None:
        """Finish ``seq`` when its last token ends it: EOS or a stop token id (once min_tokens
        are out), max_tokens or the context length. The engine also calls it for tokens that
        arrive already sampled (a prefill node's first token)."""
        reason = stop_reason(seq.token_ids[-1], seq.num_output_tokens, seq.num_tokens, seq.params,
                             self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self.finish(seq, reason)

    # ------------------------------------------------------------------ finishing
    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished; blocks are released by ``_release`` (or right away when not running)."""
        if seq.is_finished:
            return
        was_running = seq.status is SequenceStatus.RUNNING
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if not was_running:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass  # already released
        if self.kv.has_seq(seq.seq_id) and not (seq.hold_kv and seq.finish_reason is not FinishReason.ABORT):
            self.kv.free(seq.seq_id)

    def finish_and_release(self, seq: Sequence, reason: FinishReason) -> None:
        self.finish(seq, reason)
        self._release(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort every sequence of a request, wherever it is; frees all of its blocks now."""
        seqs = self.requests.get(request_id, [])
        for seq in seqs:
            self.finish_and_release(seq, FinishReason.ABORT)
        return seqs

    def forget(self, request_id: str) -> None:
        """Drop bookkeeping of a request whose sequences are all finished."""
        seqs = self.requests.get(request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[request_id]

    def request_finished(self, request_id: str) -> bool:
        seqs = self.requests.get(request_id, [])
        if not seqs:
            return True
        first = seqs[0]
        # An n > 1 request is only done once its samples exist and all of them finished.
        if first.params.n > 1 and not first.forked and not first.is_finished:
            return False
        return all(s.is_finished for s in seqs)

    def sequences(self, request_id: str) -> Seq[Sequence]:
        return self.requests.get(request_id, [])


__all__ = [
    "SampledTokens",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerOutput",
    "seq_id_of",
]
