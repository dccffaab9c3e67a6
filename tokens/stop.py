"""When a sequence stops, as one pure rule shared by the engine's scheduler and the router.

The router applies it to a prefill node's first token (a request that ends there needs no
decode slot); the scheduler applies it to every token it appends. One function, so the two can
never disagree (the router once had a copy that missed the context-length check).
"""
from __future__ import annotations

import enum
from collections.abc import Collection

from tokens.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    """Why a sample ended. The values are the names clients see; each is a ``FinishReason``
    value of serving.proto (``FINISH_REASON_<NAME>``), which tests keep in step."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the client, a deadline or a node shutting down
    ERROR = "error"  # a failure after output started (the stream carries an Error first)
    # The text ended in tool calls: the router's tool-call parser sets it (tool_calling/parser.py)
    # on a sample that stopped; never the stop rule below.
    TOOL_CALLS = "tool_calls"


def stop_reason(
    last_token: int,
    num_output_tokens: int,
    num_tokens: int,
    params: SamplingParams,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> FinishReason | None:
    """Whether a sequence ends with ``last_token``, its ``num_output_tokens``-th output token
    (``num_tokens`` = prompt + output so far): EOS or a stop token id once ``min_tokens`` are out
    (STOP), else ``max_tokens`` or the context length reached (LENGTH), else None.

    Stop strings are not here: they need the text, which only a detokenizing node has.
    """
    if num_output_tokens >= params.min_tokens:
        if (not params.ignore_eos and last_token in eos_token_ids) or last_token in params.stop_token_ids:
            return FinishReason.STOP
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
