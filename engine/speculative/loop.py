"""The speculation loop around an engine step: plan lookahead, draft, learn, count.

``LLMEngine.step`` with speculation on, in order::

    plan_lookahead   the controller picks k per decoding sequence; the scheduler reserves k slots
    propose          the proposer fills each scheduled sequence's slots with draft tokens
    (the runner verifies every k + 1 positions in the step's one forward)
    observe_step     step time -> the cost model; accepted lengths -> the controller and counters;
                     the step's yield (tokens per ms, drafting included) -> the controller's gate

The engine owns the mechanism's state-free parts (scheduler lookahead, verification in the
runner); this object owns what speculation learns and counts. The proposer is injected (the
decode role builds it, ``engine/speculative/proposers/``); what it needs from the target's forward it
declares in ``Proposer.target_states`` and receives through ``observe_target`` (the runner's
one hook), so nothing here or in the runner knows which method is running.
"""
from __future__ import annotations

import time
from typing import Callable

from engine.config import SpeculativeConfig
from engine.scheduler import SampledTokens, Scheduler, SchedulerOutput
from engine.speculative.control import SpecController, StepCost, laggard_advance
from engine.speculative.proposer import DraftRequest, Proposer, SpecStats


class SpeculativeDecoding:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer,
                 gemm_ms: Callable[[int], float] | None = None) -> None:
        """``gemm_ms``: the CPU kernel plan's matmul time by row count (None off CPU), the
        cost model's prior."""
        self.proposer = proposer
        self.step_cost = StepCost(config, gemm_ms)
        self.controller = SpecController(config, proposer.draft_cost, self.step_cost, batched=proposer.batched)
        self.stats = SpecStats()  # node totals
        self._seq_stats: dict[str, SpecStats] = {}
        self._draft_ms = 0.0  # drafting time of the step being run

    def plan_lookahead(self, scheduler: Scheduler) -> dict[str, int] | None:
        """seq id -> draft slots to reserve this step (None: no decoding sequence)."""
        candidates = [s.seq_id for s in scheduler.decode_candidates()]
        return self.controller.plan(candidates, scheduler.num_running) if candidates else None

    def propose(self, sched: SchedulerOutput, block_table_of: Callable[[str], list[int]],
                batch_size: int) -> None:
        """Fill the scheduled sequences' lookahead slots with drafts (``draft_token_ids``,
        ``draft_probs``, ``draft_bucket`` on each item), trimmed to what pays."""
        if sched.block_copies:
            self.proposer.copy_blocks(sched.block_copies)
        self._draft_ms = 0.0
        items = [it for it in sched.scheduled if it.num_lookahead > 0]
        if not items:
            return
        reqs = [DraftRequest(it.seq, it.num_lookahead, block_table_of(it.seq.seq_id)) for it in items]
        t0 = time.perf_counter()
        proposals = self.proposer.propose(reqs)
        # The proposer's own estimate of its cost is a guess; what it took here is not.
        rounds = max(r.k for r in reqs) if self.proposer.batched else sum(r.k for r in reqs)
        self._draft_ms = (time.perf_counter() - t0) * 1e3
        self.controller.observe_draft(rounds, self._draft_ms)
        lengths = [min(len(p.token_ids), it.num_lookahead) for it, p in zip(items, proposals)]
        if any(p.bucket is not None for p in proposals):
            lengths = self.controller.trim(
                [(it.seq.seq_id, n, p.bucket) for it, n, p in zip(items, lengths, proposals)], batch_size)
        for it, prop, n in zip(items, proposals, lengths):
            it.draft_token_ids = [int(t) for t in prop.token_ids[:n]]
            it.draft_probs = None if prop.probs is None or n == 0 else prop.probs[:n]
            it.draft_bucket = prop.bucket if n else None

    def observe_step(self, sched: SchedulerOutput, sampled: dict[str, SampledTokens], forward_ms: float,
                     whole_batch: bool = False) -> None:
        """Learn from a finished step: its time (decode and verification steps only: a prefill
        chunk says nothing about k + 1 query rows) and each draft's accepted length.
        ``whole_batch``: the caller waits for every request of the batch and none is queued,
        so the gate values the step by how far it moved the request with the fewest tokens."""
        if all(it.num_new_tokens == 1 for it in sched.scheduled):
            rows = sum(1 + len(it.draft_token_ids) for it in sched.scheduled)
            verifying = any(it.draft_token_ids for it in sched.scheduled)
            self.step_cost.observe(rows, forward_ms, verifying)
            # A step whose drafts were all trimmed away still paid for drafting: it counts
            # against speculation in the gate like a verifying step.
            emitted = sum(len(sampled[it.seq.seq_id].token_ids) for it in sched.scheduled
                          if it.seq.seq_id in sampled)
            if whole_batch and len(sched.scheduled) > 1:
                running = [it.seq for it in sched.scheduled if not it.seq.is_finished and it.seq.seq_id in sampled]
                after = [s.num_output_tokens for s in running]
                before = [n - len(sampled[s.seq_id].token_ids) for s, n in zip(running, after)]
                # Per sequence, as the gate's yields are: B x the laggard's advance (0 when the
                # step ended the batch, which then counts per token).
                emitted = len(sched.scheduled) * laggard_advance(before, after) or emitted
            self.controller.gate.observe(len(sched.scheduled), emitted, forward_ms + self._draft_ms,
                                         verifying or self._draft_ms > 0)
        for it in sched.scheduled:
            if not it.draft_token_ids or it.seq.seq_id not in sampled:
                continue
            sid = it.seq.seq_id
            drafted, accepted = len(it.draft_token_ids), len(sampled[sid].token_ids) - 1
            self.controller.observe(sid, drafted, accepted, it.draft_bucket)
            self._seq_stats.setdefault(sid, SpecStats()).record(drafted, accepted)
            self.stats.record(drafted, accepted)

    def seq_stats(self, seq_id: str) -> SpecStats:
        """The counters of one sample so far (zeros before its first draft)."""
        return self._seq_stats.get(seq_id, SpecStats())

    def forget(self, seq_id: str) -> None:
        """The sample finished: drop what the controller, the counters and the proposer keep."""
        self._seq_stats.pop(seq_id, None)
        self.controller.forget(seq_id)
        self.proposer.forget(seq_id)

    def snapshot(self) -> dict:
        # The counters plus what the controller currently believes a step and a draft cost:
        # the numbers to look at when speculation switches itself off.
        return {**self.stats.as_dict(), "step_cost_ms": self.step_cost.snapshot(),
                "gate_yield_ratio": self.controller.gate.snapshot(),
                "draft_round_ms": round(self.controller.draft_round_ms, 3)}
