"""Adaptive speculation: how many draft tokens each sequence gets this step (pure logic).

Per sequence, acceptance is tracked as a decayed count of accepted vs rejected draft tokens,
giving an estimate ``a`` of the chance that a draft token is accepted given the one before it
was. Verifying k draft tokens then yields, in expectation, ``E(k) = 1 + a + ... + a^k`` tokens
(the 1 is the recovered/bonus token every verification produces) and costs, relative to a
plain decode step, ``C(k) = 1 + verify_fixed_cost + k * (verify_token_cost + draft_cost)``. The controller picks the
k in ``0 .. k_max`` with the best ``E(k) / C(k)``; k = 0 (ratio 1) means speculation does not
pay for this sequence now. A sequence switched off is probed again after ``PROBE_EVERY`` steps
(k = half of k_max when drafting is free, k = 1 when it costs), so a request whose text turns
repetitive later is not stuck off; a new sequence probes on its first step. Every probe that
leaves it off doubles the wait before the next one (up to ``MAX_PROBE_EVERY``): with a drafter
that never pays (an early exit whose drafts the target rejects), probes cost a few percent
instead of one expensive step in every ``PROBE_EVERY``.

Batch: the step's speculative tokens are capped at ``max_tokens_per_step * (1 - (B - 1) /
max_batch_size)`` for B running sequences, handed out to the sequences with the best
acceptance first.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import SpeculativeConfig

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


def expected_tokens(a: float, k: int) -> float:
    """1 + a + a^2 + ... + a^k: tokens one verification of k drafts yields on average."""
    return sum(a**i for i in range(k + 1))


def best_k(a: float, k_max: int, token_cost: float, fixed_cost: float = 0.0) -> int:
    """The k in 0 .. k_max maximizing expected tokens per unit of step cost."""
    best, best_ratio = 0, 1.0
    for k in range(1, k_max + 1):
        ratio = expected_tokens(a, k) / (1.0 + fixed_cost + k * token_cost)
        if ratio > best_ratio + 1e-9:
            best, best_ratio = k, ratio
    return best


def step_budget(cfg: SpeculativeConfig, batch_size: int) -> int:
    """Speculative tokens allowed in a step with ``batch_size`` running sequences."""
    shrink = max(0.0, 1.0 - (batch_size - 1) / cfg.max_batch_size)
    return int(cfg.max_tokens_per_step * shrink)


NODE_DECAY = 0.99  # the node-wide estimate remembers a few hundred verifications


class SpecController:
    """Per-sequence k from per-sequence acceptance; a new sequence starts from the node-wide
    acceptance of recent sequences (the optimistic prior only until there is any), so a drafter
    that rarely pays on this node does not cost every new request a losing first probe."""

    def __init__(self, cfg: SpeculativeConfig, draft_cost: float) -> None:
        self.cfg = cfg
        self.token_cost = cfg.verify_token_cost + draft_cost
        # A free drafter (n-gram) probes with several tokens to measure acceptance; a costly one
        # with a single token, the cheapest verification that still tells.
        self.probe_k = 1 if draft_cost > 0 else max(1, (cfg.num_speculative_tokens + 1) // 2)
        self._seqs: dict[str, _SeqState] = {}
        self._node_accepted = 0.0
        self._node_rejected = 0.0
        # How long switched-off sequences on this node currently wait between probes: a new
        # sequence continues the node's back-off instead of starting it over.
        self._node_probe_every = PROBE_EVERY

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
        k_max = self.cfg.num_speculative_tokens
        wanted: list[tuple[float, str, int]] = []
        for sid in candidates:
            st = self._seqs.get(sid)
            if st is None:
                st = self._seqs[sid] = self._new_state()
            if not self.cfg.adaptive:
                wanted.append((1.0, sid, k_max))
                continue
            k = best_k(st.acceptance, k_max, self.token_cost, self.cfg.verify_fixed_cost)
            if k == 0:
                st.off_steps += 1
                if st.off_steps < st.probe_every:
                    continue
                st.off_steps, k = 0, self.probe_k
                st.probe_every = min(MAX_PROBE_EVERY, 2 * st.probe_every)
                self._node_probe_every = max(self._node_probe_every, st.probe_every)
            else:
                st.off_steps, st.probe_every = 0, PROBE_EVERY
                self._node_probe_every = PROBE_EVERY
            wanted.append((st.acceptance, sid, k))
        wanted.sort(key=lambda w: -w[0])
        plan: dict[str, int] = {}
        for _, sid, k in wanted:
            k = min(k, budget)
            if k <= 0:
                break
            plan[sid] = k
            budget -= k
        return plan

    def observe(self, seq_id: str, num_drafted: int, num_accepted: int) -> None:
        """A verification of ``num_drafted`` tokens accepted the first ``num_accepted``."""
        if num_drafted == 0:
            return
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
