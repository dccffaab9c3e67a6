"""A sequence: one sample of one request, as the scheduler tracks it (plain data, no torch)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from tokens.sampling_params import SamplingParams
from tokens.stop import FinishReason


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def seq_id_of(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


@dataclass(slots=True, eq=False)
class Sequence:
    """Token ids plus how many of them already have KV in the paged cache.

    The scheduler's one invariant: ``num_computed_tokens`` catches up with ``num_tokens``.
    There is no separate prefill or decode phase; a step computes the next slice of tokens
    whose KV is missing, and when that slice reaches the last token the step also samples::

        token_ids:  | prompt ......................... | output ...... |
                    |<--- num_computed_tokens --->|<-- next slice -->|
                    |  KV in cache (cached+computed)|  computed now    | -> sample

    After a preemption (recompute) the KV is dropped and ``num_computed_tokens`` goes back to
    0; prompt and output so far are recomputed, usually straight from the prefix cache.
    """

    request_id: str
    index: int  # sample index within the request (n > 1 forks share the prompt's blocks)
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    forked: bool = False  # True once the n-1 sibling samples exist
    num_preemptions: int = 0
    # Prefill role: keep the blocks after finishing until the KV has been handed over.
    hold_kv: bool = False
    # Prefill role: report, layer by layer, which blocks hold final KV (ModelRunner's
    # kv_layer_listener), so they can be sent while later layers and chunks compute.
    stream_kv: bool = False
    # The request's cache salt (tokens/block_hash.py): its blocks are hashed from the salted
    # root, so they are matched and shared only within the salt. b"": no salt.
    cache_salt: bytes = b""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def seq_id(self) -> str:
        return seq_id_of(self.request_id, self.index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_fork(self) -> bool:
        return self.params.n > 1 and self.index == 0 and not self.forked
