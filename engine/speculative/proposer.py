"""The seam between the engine and speculative-decoding proposers (plain data, no torch).

The engine owns the mechanism (lookahead slots, one verification forward, rejection sampling,
rollback); a ``Proposer`` only guesses tokens. Proposers live with the decode role
(``engine/speculative/proposers/``) and are injected: the engine never imports them.

One speculating sequence in one step, k = 3::

    token_ids   | ... verified ... | t |            t: last token, no KV yet (as in a decode)
    positions                      s   s+1 s+2 s+3
    verify      runs [t, d1, d2, d3] at s .. s+3   -> target probs p0 p1 p2 p3
    accept      d1 ok, d2 rejected                 -> emit d1 and r (recovered from p1 - q1)
    after       | ... verified ... | t  d1 | r |   num_computed_tokens = s + 2, KV at s+2.. freed
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from engine.sequence import Sequence


@dataclass(slots=True)
class DraftRequest:
    """One sequence that may speculate this step. The proposer reads, never mutates, ``seq``.

    ``seq.token_ids[-1]`` is the last token (its KV is written by this step's verification);
    ``seq.num_computed_tokens`` positions have target KV. ``block_table`` covers positions
    ``[0, num_computed_tokens + 1 + k)``: a proposer with KV shared with the target, or its own
    KV indexed by the same block ids, may write draft KV there.
    """

    seq: Sequence
    k: int  # most draft tokens wanted (>= 1)
    block_table: list[int]


class Proposal(NamedTuple):
    token_ids: list[int]  # 0 .. k draft tokens
    # [len(token_ids), V] float32 tensor: the distribution each draft token was drawn from, for
    # exact rejection sampling; None for deterministic proposers (n-gram, argmax heads): q is
    # one-hot at the draft token then.
    probs: Any | None = None
    # Drafts in one bucket are alike in how often the target accepts them (n-gram: the length
    # of the matched suffix, 1 being a weak guess and n_max a strong one); the controller keeps
    # acceptance per bucket and trims each draft to what its bucket says pays. None: no signal.
    bucket: int | None = None


@dataclass(frozen=True, slots=True)
class TargetStates:
    """What a proposer needs from the target's forward pass, handed to ``observe_target``.

    ``positions``: "last" gives, per sampled sequence, the state that produced its newest token
    (Medusa heads); "final" gives every position whose input token is final: prefill chunks,
    decodes and the accepted run of a verification, never a rejected draft (EAGLE).
    ``layer``: None for the model's output (after the final norm, what the LM head reads);
    ``i`` for the residual stream after decoder layer i, before any norm (checkpoints trained
    on another layer's features, e.g. EAGLE's pre-norm last layer).
    """

    positions: Literal["last", "final"]
    layer: int | None = None


class Proposer(Protocol):
    """Guesses the next tokens of several sequences at once.

    ``propose`` may write draft-side KV (its own cache, or the target's layers it shares), only
    at positions the request's block table covers; it must not touch the scheduler's state.
    """

    # Time of one draft token relative to one target decode step at batch 1 (n-gram ~0,
    # early exit L / num_layers): the adaptive controller's prior, until propose is timed.
    draft_cost: float
    # True: one drafting round drafts every sequence of the step (batched), so a step's
    # drafting time follows its largest k; False: sequences draft one after another.
    batched: bool

    # What the proposer reads from the target's forward (None: nothing; most proposers).
    target_states: TargetStates | None

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]: ...

    def observe_target(self, seq_id: str, first_position: int, states: Any) -> None:
        """Only with ``target_states``: after each step, the target's states of ``seq_id`` at
        positions ``first_position ..``, a ``[n, hidden]`` tensor the proposer may keep."""
        ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write copies the target's cache just got; a proposer with its own paged KV
        applies them too (same block ids)."""
        ...

    def forget(self, seq_id: str) -> None:
        """The sequence finished: drop whatever the proposer keeps about it (states included)."""
        ...


@dataclass(slots=True)
class SpecStats:
    """Counters of one sequence (or, merged, of a node).

    A *draft* is one verification step that carried at least one draft token; the *accepted
    length* of a draft is how many of its tokens the target accepted (the recovered or bonus
    token that every verification adds is not counted).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Index j: drafts that proposed / got accepted a token at draft position j.
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        _add_ones(self.proposed_per_position, num_drafted)
        _add_ones(self.accepted_per_position, num_accepted)

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft token j accepted | a draft proposed a token at j)."""
        acc = self.accepted_per_position + [0] * (len(self.proposed_per_position) - len(self.accepted_per_position))
        return [a / p if p else 0.0 for a, p in zip(acc, self.proposed_per_position)]

    @property
    def mean_accepted_length(self) -> float:
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {
            "drafts": self.num_drafts,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "acceptance_per_position": self.acceptance_per_position,
            "mean_accepted_length": self.mean_accepted_length,
        }


def _add_ones(counts: list[int], n: int) -> None:
    counts.extend([0] * (n - len(counts)))
    for j in range(n):
        counts[j] += 1
