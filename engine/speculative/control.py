"""Adaptive speculation: how many draft tokens each sequence gets this step (pure logic).

Per sequence, acceptance is tracked as a decayed count of accepted vs rejected draft tokens,
giving an estimate ``a`` of the chance that a draft token is accepted given the one before it
was. Verifying k draft tokens then yields, in expectation, ``E(k) = 1 + a + ... + a^k`` tokens
(the 1 is the recovered/bonus token every verification produces).

What verification costs comes from ``StepCost`` (engine/speculative/step_cost.py): the
predicted time of one forward over T query tokens, learned from the steps the engine runs.

The controller hands out drafts greedily, best acceptance first: sequence i gets the k in
``0 .. k_max`` that maximizes the whole step's expected tokens per unit of time,
``(tokens so far + E(k) - 1) / (cost(T so far + k) + draft time)``. A step of B decoding
sequences starts at T = B and B tokens, so the same rule that picks k at batch 1 shrinks
speculation as the batch grows: once the forward is compute-bound, an extra row costs about
as much as the tokens it is expected to add. k = 0 means speculation does not pay for this
sequence now. A sequence switched off is probed again after ``PROBE_EVERY`` steps (k = half of
k_max when drafting is free, k = 1 when it costs), so a request whose text turns repetitive
later is not stuck off; a new sequence probes on its first step. Every probe that leaves it
off doubles the wait before the next one (up to ``MAX_PROBE_EVERY``): with a drafter that never
pays (an early exit whose drafts the target rejects), probes cost a few percent instead of one
expensive step in every ``PROBE_EVERY``.

Confidence buckets: a proposal may say which bucket its draft falls in (n-gram: the matched
suffix length). Acceptance is also kept per bucket, node-wide, and once the drafts of a step
are known, ``trim`` runs the same greedy with each draft's bucket acceptance and cuts it to the
length that pays (possibly 0): a weak 1-token n-gram match is dropped while a long match in
the same request drafts k_max tokens. ``plan`` then only reserves room: for a free drafter it
plans with the best of the request's and the best bucket's acceptance.

Hard cap: the step's speculative tokens never exceed ``max_tokens_per_step * (1 - (B - 1) /
max_batch_size)`` for B running sequences.

Step gate (``StepGate``): everything above rests on predicted costs, and a step's real cost has
parts the model learns late (a verifying step's fixed extra, the drafting time). So the
controller also keeps, per batch-size bucket (powers of two), what whole steps actually
yielded: emitted tokens per sequence per predicted plain-step time of steps that verified drafts
(drafting time included) against plain steps of the same bucket (measured, or 1 by the
prediction until one is seen). Where verifying steps yield less, speculation is off for every
sequence of a step of that bucket, and a probe is let through now and then
(``GATE_PROBE_EVERY``, doubling while it keeps losing) to notice when the text turns repetitive:
one draft, of the sequence that accepts best, not a draft for every sequence (at batch 8 a
full verifying step costs 30-40% more than a plain one on CPU; one short draft a few percent).
This is what keeps a batch from getting slower with speculation on.

What a step yielded depends on who waits for it. A server's requests each wait for their own
tokens, so every emitted token counts. A caller of ``LLMEngine.generate`` waits for the whole
batch, which ends when its last request does: once nothing is queued (no request takes a
freed slot), a token that puts one request further ahead of the others shortens nothing. There
the gate counts a step's ``laggard_advance``: how far it moved the request with the fewest
output tokens. Measured at batch 8 on open-ended text, where 7 of 8 requests run to the
128-token limit: verifying steps yielded as many tokens per ms as plain ones, but the batch
took 127 steps with speculation and without; judged per token the gate let ~50 such steps
through per batch (each 30-40% dearer than a plain step), judged by the laggard about none.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Callable

from engine.config import SpeculativeConfig
from engine.speculative.step_cost import StepCost, expected_tokens

PROBE_EVERY = 16  # steps a switched-off sequence first waits before a probe
MAX_PROBE_EVERY = 256
DECAY = 0.9  # per observation: older verifications weigh less
# Prior pseudo-counts: start optimistic (a = 0.7) so a new request tries speculation at once.
PRIOR_ACCEPTED, PRIOR_REJECTED = 1.4, 0.6


@dataclass(slots=True)
class _SeqState:
    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    off_steps: int = PROBE_EVERY - 1  # probe on the first step
    probe_every: int = PROBE_EVERY

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


def step_budget(cfg: SpeculativeConfig, batch_size: int) -> int:
    """Speculative tokens allowed in a step with ``batch_size`` running sequences."""
    shrink = max(0.0, 1.0 - (batch_size - 1) / cfg.max_batch_size)
    return int(cfg.max_tokens_per_step * shrink)


def laggard_advance(before: list[int], after: list[int]) -> int:
    """Output tokens of the sequences still running, before and after a step -> how far the
    step moved the one with the fewest (1 for a plain step, more only if every sequence tied
    for last got more than one). 0 when no sequence is left running."""
    if not after:
        return 0
    return min(after) - min(before)


GATE_MIN_STEPS = 3  # verifying steps of one batch size before the gate judges them
GATE_DECAY = 0.9  # per observed step: the gate follows the text as it changes
GATE_PROBE_EVERY = 8  # steps an off gate first waits before letting a verifying step through
GATE_MAX_PROBE_EVERY = 64


class Verdict(IntEnum):
    """The gate's answer for a step: OFF is falsy, so ``if gate.allow(b)`` reads naturally."""
    OFF = 0
    ON = 1
    PROBE = 2  # off, but one draft may be verified to notice when the text turns repetitive


class StepGate:
    """Per batch-size bucket: do verifying steps yield more than plain ones? (pure logic)

    Yields are measured relative to ``plain_ms(B)``, the predicted time of a plain step of B
    rows (``StepCost``, which learns it from the plain steps it sees): a step of B sequences
    that emitted ``tokens`` in ``ms`` counts ``tokens / B`` tokens per sequence over ``ms /
    plain_ms(B)`` plain-step times. A plain step scores about 1 by construction, a verifying
    step above 1 when it pays. Normalised that way, steps of nearby batch sizes can share one
    verdict: buckets are powers of two (1, 2-3, 4-7, 8-15, ...). Why share: with natural
    stopping a batch shrinks by one every few steps (8, 7, 6, ...), and a verdict per exact
    size had to be learned again, losing steps included, at every size; that made the open set
    of ``pdserve bench specdec --batch 8`` 7.5% slower with speculation than without. Plain
    steps of the bucket are measured too (against the same prediction), so an error of the
    prediction cancels out of the comparison."""

    def __init__(self, plain_ms: Callable[[int], float]) -> None:
        self.plain_ms = plain_ms
        self._plain: dict[int, list[float]] = {}  # bucket -> [decayed tokens/seq, decayed plain-step times, steps]
        self._spec: dict[int, list[float]] = {}
        self._off_steps: dict[int, int] = {}
        self._probe_every: dict[int, int] = {}

    @staticmethod
    def bucket(batch: int) -> int:
        return batch.bit_length()  # 1 -> 1, 2-3 -> 2, 4-7 -> 3, 8-15 -> 4

    @staticmethod
    def bucket_label(bucket: int) -> str:
        lo, hi = 1 << (bucket - 1), (1 << bucket) - 1
        return str(lo) if lo == hi else f"{lo}-{hi}"

    def observe(self, batch: int, tokens: int, ms: float, verifying: bool) -> None:
        """A decode step of ``batch`` sequences emitted ``tokens`` in ``ms`` (drafting included)."""
        if batch < 1 or ms <= 0:
            return
        unit = max(self.plain_ms(batch), 1e-9)
        acc = (self._spec if verifying else self._plain).setdefault(self.bucket(batch), [0.0, 0.0, 0])
        acc[0] = GATE_DECAY * acc[0] + tokens / batch
        acc[1] = GATE_DECAY * acc[1] + ms / unit
        acc[2] += 1

    def rates(self, batch: int) -> tuple[float | None, float]:
        """(verifying steps' relative yield, or None before GATE_MIN_STEPS of them in this
        bucket; plain steps' relative yield, 1.0 until one is measured)."""
        b = self.bucket(batch)
        s = self._spec.get(b)
        spec = s[0] / s[1] if s is not None and s[2] >= GATE_MIN_STEPS else None
        p = self._plain.get(b)
        plain = p[0] / p[1] if p is not None and p[2] >= 1 else 1.0
        return spec, plain

    def allow(self, batch: int) -> Verdict:
        """May this step (``batch`` running sequences) verify drafts, and how many?"""
        spec, plain = self.rates(batch)
        b = self.bucket(batch)
        if spec is None or spec >= plain:
            self._off_steps[b] = 0
            self._probe_every[b] = GATE_PROBE_EVERY
            return Verdict.ON
        off = self._off_steps.get(b, 0) + 1
        every = self._probe_every.get(b, GATE_PROBE_EVERY)
        if off < every:
            self._off_steps[b] = off
            return Verdict.OFF
        self._off_steps[b] = 0
        self._probe_every[b] = min(GATE_MAX_PROBE_EVERY, 2 * every)
        return Verdict.PROBE

    def snapshot(self) -> dict[str, float]:
        """Bucket ("1", "2-3", "4-7", ...) -> verifying / plain yield, for the buckets judged so far."""
        out = {}
        for b in sorted(self._spec):
            spec, plain = self.rates(1 << (b - 1))
            if spec is not None:
                out[self.bucket_label(b)] = round(spec / plain, 3)
        return out


NODE_DECAY = 0.99  # the node-wide estimate remembers a few hundred verifications
# Speculating must beat not speculating by this factor in expected tokens per ms: the cost
# model is an estimate, and a choice inside its error (a bf16 draft that costs nearly what it
# saves) made the open set of `pdserve bench specdec` slower before this margin.
MIN_GAIN = 1.04
BUCKET_MIN_WEIGHT = 4.0  # decayed verifications a bucket needs before its acceptance is used


class SpecController:
    """Per-sequence k from per-sequence acceptance; a new sequence starts from the node-wide
    acceptance of recent sequences (the optimistic prior only until there is any), so a drafter
    that rarely pays on this node does not cost every new request a losing first probe."""

    def __init__(self, cfg: SpeculativeConfig, draft_cost: float, step_cost: StepCost | None = None,
                 batched: bool = True) -> None:
        self.cfg = cfg
        self.draft_cost = draft_cost
        self.batched = batched  # the proposer drafts all sequences of a step in shared rounds
        self.step_cost = step_cost if step_cost is not None else StepCost(cfg)
        self.gate = StepGate(lambda b: self.step_cost.cost(b, False))
        # A free drafter (n-gram) probes with several tokens to measure acceptance; a costly one
        # with a single token, the cheapest verification that still tells.
        self.probe_k = 1 if draft_cost > 0 else max(1, (cfg.num_speculative_tokens + 1) // 2)
        self._seqs: dict[str, _SeqState] = {}
        self._node_accepted = 0.0
        self._node_rejected = 0.0
        # How long switched-off sequences on this node currently wait between probes: a new
        # sequence continues the node's back-off instead of starting it over.
        self._node_probe_every = PROBE_EVERY
        self._buckets: dict[int, list[float]] = {}  # bucket -> [accepted, rejected, weight]
        self._bucket_skips: dict[int, int] = {}  # bucket -> drafts trimmed to 0 since its last probe
        self._draft_round_ms: float | None = None  # measured time of one drafting round

    def observe_draft(self, rounds: int, ms: float) -> None:
        """A proposal call that ran ``rounds`` sequential drafting rounds took ``ms``."""
        if rounds < 1 or ms < 0:
            return
        # Averaged from the proposer's own estimate rather than started at the first sample,
        # and one sample moves it at most 4x: a model drafter's first call for a request also
        # catches up over its prompt (a draft prefill), which is not a round's cost.
        prev = self.draft_round_ms
        per = min(ms / rounds, 4 * prev) if prev > 0 else ms / rounds
        self._draft_round_ms = DECAY * prev + (1 - DECAY) * per

    @property
    def draft_round_ms(self) -> float:
        """What one more drafting round costs: measured once proposals have run, before that
        the proposer's own estimate (``draft_cost`` batch-1 decode steps)."""
        if self._draft_round_ms is not None:
            return self._draft_round_ms
        return self.draft_cost * self.step_cost.cost(1)

    def bucket_acceptance(self, bucket: int | None) -> float | None:
        b = self._buckets.get(bucket) if bucket is not None else None
        if b is None or b[2] < BUCKET_MIN_WEIGHT:
            return None
        return b[0] / (b[0] + b[1]) if b[0] + b[1] > 0 else 0.0

    def _best_bucket_acceptance(self) -> float:
        known = [a for a in (self.bucket_acceptance(b) for b in self._buckets) if a is not None]
        return max(known, default=0.0)

    def _new_state(self) -> _SeqState:
        total = self._node_accepted + self._node_rejected
        if total < 1.0:
            return _SeqState()
        # Same weight as the prior (2 pseudo-observations), at the node's acceptance.
        w = (PRIOR_ACCEPTED + PRIOR_REJECTED) / total
        st = _SeqState(accepted=self._node_accepted * w, rejected=self._node_rejected * w)
        st.off_steps = 0  # the node's experience replaces the first-step probe
        st.probe_every = self._node_probe_every
        return st

    def plan(self, candidates: list[str], batch_size: int) -> dict[str, int]:
        """seq ids that could speculate now -> k (only entries with k > 0)."""
        budget = step_budget(self.cfg, batch_size)
        verdict = self.gate.allow(batch_size) if self.cfg.adaptive and budget > 0 else Verdict.ON
        if not verdict:
            return {}
        k_max = self.cfg.num_speculative_tokens
        states = []
        # Reserving room is free for a free drafter: trim() decides per draft, so plan with the
        # best bucket's acceptance when it beats the request's own.
        floor = self._best_bucket_acceptance() if self.draft_cost == 0 else 0.0
        for sid in candidates:
            st = self._seqs.get(sid)
            if st is None:
                st = self._seqs[sid] = self._new_state()
            states.append((max(st.acceptance, floor), sid, st))
        states.sort(key=lambda e: -e[0])
        if verdict == Verdict.PROBE:  # the gate is off: one draft, of the best acceptor, tells enough
            return {states[0][1]: min(self.probe_k, budget, k_max)} if states else {}
        greedy = _StepGreedy(self.step_cost.cost, self.draft_round_ms, batch_size, self.batched)
        plan: dict[str, int] = {}
        for a, sid, st in states:
            if not self.cfg.adaptive:
                k = min(k_max, budget)
            else:
                k = greedy.best(a, min(k_max, budget))
                if k == 0:
                    st.off_steps += 1
                    if st.off_steps < st.probe_every or budget <= 0:
                        continue
                    st.off_steps, k = 0, min(self.probe_k, budget)
                    st.probe_every = min(MAX_PROBE_EVERY, 2 * st.probe_every)
                    self._node_probe_every = max(self._node_probe_every, st.probe_every)
                else:
                    st.off_steps, st.probe_every = 0, PROBE_EVERY
                    self._node_probe_every = PROBE_EVERY
            if k <= 0:
                continue
            plan[sid] = k
            budget -= k
            greedy.add(a, k)
        return plan

    def trim(self, drafts: list[tuple[str, int, int | None]], batch_size: int) -> list[int]:
        """How many tokens of each proposed draft to verify: ``drafts`` holds (seq id, drafted
        length, bucket). A draft whose bucket has enough history is cut to the length its
        bucket's acceptance pays for in this step; any other keeps its planned length."""
        if not self.cfg.adaptive:
            return [n for _, n, _ in drafts]
        greedy = _StepGreedy(self.step_cost.cost, 0.0, batch_size, True)  # drafting is already paid
        keep = [n for _, n, _ in drafts]
        rated = []
        for i, (sid, n, bucket) in enumerate(drafts):
            a = self.bucket_acceptance(bucket)
            if a is None:
                st = self._seqs.get(sid)
                greedy.add(st.acceptance if st is not None else 0.0, n)
            else:
                rated.append((a, i))
        for a, i in sorted(rated, reverse=True):
            keep[i] = greedy.best(a, drafts[i][1])
            bucket = drafts[i][2]
            if keep[i] == 0:
                # A bucket that is always trimmed is never observed again: verify one of its
                # drafts now and then, so a bucket judged on early luck can recover.
                skips = self._bucket_skips.get(bucket, 0) + 1
                if skips >= PROBE_EVERY:
                    skips, keep[i] = 0, min(drafts[i][1], self.probe_k)
                self._bucket_skips[bucket] = skips
            greedy.add(a, keep[i])
        return keep

    def observe(self, seq_id: str, num_drafted: int, num_accepted: int, bucket: int | None = None) -> None:
        """A verification of ``num_drafted`` tokens accepted the first ``num_accepted``."""
        if num_drafted == 0:
            return
        if bucket is not None:
            b = self._buckets.setdefault(bucket, [0.0, 0.0, 0.0])
            b[0] = NODE_DECAY * b[0] + num_accepted
            b[1] = NODE_DECAY * b[1] + (1 if num_accepted < num_drafted else 0)
            b[2] = NODE_DECAY * b[2] + 1
        st = self._seqs.get(seq_id)
        if st is None:
            st = self._seqs[seq_id] = self._new_state()
        rejected = 1 if num_accepted < num_drafted else 0
        st.accepted = DECAY * st.accepted + num_accepted
        st.rejected = DECAY * st.rejected + rejected
        self._node_accepted = NODE_DECAY * self._node_accepted + num_accepted
        self._node_rejected = NODE_DECAY * self._node_rejected + rejected

    def forget(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)


class _StepGreedy:
    """One step's running totals for handing out drafts: rows so far, expected tokens so far
    and drafting rounds so far; ``best`` is the k that maximizes expected tokens per ms.

    A batched drafter drafts every sequence of a step together, one round per draft position,
    so the step's drafting time is ``round_ms * max k``; a sequential one (EAGLE) pays
    ``round_ms * sum k``."""

    def __init__(self, cost: Callable[[int, bool], float], round_ms: float, batch_size: int, batched: bool) -> None:
        self.cost = cost
        self.round_ms = round_ms
        self.batched = batched
        self.rows = self.batch = max(1, batch_size)
        self.tokens = float(self.rows)
        self.rounds = 0

    def _rounds(self, k: int) -> int:
        return max(self.rounds, k) if self.batched else self.rounds + k

    def best(self, a: float, k_max: int) -> int:
        now = self.cost(self.rows, self.rows > self.batch) + self.rounds * self.round_ms
        k, best = 0, self.tokens / now * MIN_GAIN
        for kk in range(1, k_max + 1):
            r = (self.tokens + expected_tokens(a, kk) - 1) / (
                self.cost(self.rows + kk, True) + self._rounds(kk) * self.round_ms)
            if r > best * (1 + 1e-9):
                k, best = kk, r
        return k

    def add(self, a: float, k: int) -> None:
        self.rows += k
        self.tokens += expected_tokens(a, k) - 1
        self.rounds = self._rounds(k)
