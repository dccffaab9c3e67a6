"""Plain result types of the SDK (no protobuf in user code)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True, slots=True)
class Chunk:
    """New output of sample ``index`` since its previous chunk."""

    text: str
    token_ids: tuple[int, ...]
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    # Speculative decoding on the decode node (see serving.proto Usage); zeros when off.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_per_position: tuple[float, ...] = ()
    spec_mean_accepted_length: float = 0.0


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds from the request's arrival at the router (see serving.proto Timings)."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    first_token_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made (the router parsed it from the text in the model's own format)."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments

    def parsed_arguments(self) -> Any:
        return json.loads(self.arguments)


@dataclass(frozen=True, slots=True)
class Completion:
    """One finished sample: its whole text and tokens, why it stopped, usage and timings."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length" | "abort" | "error" | "tool_calls"
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    logprobs: tuple[TokenLogprob, ...] = ()
    # Requests with tools: the calls parsed from ``text`` (which stays the model's raw text).
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    max_context_length: int
