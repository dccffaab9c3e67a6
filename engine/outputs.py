"""What ``LLMEngine.step`` hands its callers, and the per-request state it is built from.

Plain data, no torch. Each step yields one ``RequestOutput`` per request that moved, with a
``CompletionOutput`` per sample that moved. ``RequestState`` is the engine's record of a request
between steps: each sample's text (``SequenceText``), the logprobs so far, its ``RequestTimes``.
Those are timestamps the engine stamps as the request goes (arrival, first scheduled, first
token, finished); the histograms built from them are ``telemetry.metrics.RequestMetrics``,
filled by the node.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from engine.scheduler import SampledTokens
from engine.sequence import Sequence, seq_id_of
from engine.sequence_text import SequenceText
from engine.speculative.proposer import SpecStats
from tokens.sampling_params import SamplingParams


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]  # every generated token so far
    new_token_ids: list[int]  # generated in this step
    text: str  # detokenized so far, stop strings trimmed ("" without a tokenizer)
    text_delta: str
    logprobs: list[float] | None = None
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    spec: SpecStats | None = None  # speculative-decoding counters of this sample (None: off)


@dataclass(slots=True)
class RequestTimes:
    """When things happened to a request (``time.monotonic`` seconds), and how often it was
    preempted."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Times any of the request's sequences was preempted (recomputed) so far: a node's trace
    # marks each new one as it streams the request's outputs.
    num_preemptions: int = 0

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestTimes


@dataclass(slots=True)
class RequestState:
    """The engine's record of one request from ``add_request`` to its last output. The engine
    keeps the scheduling side (finishing a sequence, cutting tokens at a stop string)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    times: RequestTimes
    texts: dict[int, SequenceText] = field(default_factory=dict)  # by sample index (with a tokenizer)
    logprobs: dict[int, list[float]] = field(default_factory=dict)  # by sample index, when asked for
    # Output tokens this request produced elsewhere before it came here (a migrated request):
    # not streamed again; each sample's text replays them (``text``).
    resumed: int = 0

    def text(self, seq: Sequence, tokenizer: Any) -> SequenceText:
        """The sample's text state, made at its first output token."""
        text = self.texts.get(seq.index)
        if text is None:
            start = seq.num_prompt_tokens
            text = self.texts[seq.index] = SequenceText(
                tokenizer, seq.prompt_token_ids, self.params.stop, self.params.include_stop_str_in_output,
                sent_token_ids=seq.token_ids[start : start + self.resumed])
        return text

    def completion(self, seq: Sequence, new_ids: list[int], delta: str, logprobs: list[float] | None,
                   tops: list | None, spec: SpecStats | None) -> CompletionOutput:
        """``logprobs`` / ``tops``: one entry per new token, or None."""
        if logprobs is not None:  # a new list: earlier outputs keep theirs
            self.logprobs[seq.index] = self.logprobs.get(seq.index, []) + list(logprobs)
        text = self.texts.get(seq.index)
        return CompletionOutput(
            index=seq.index,
            token_ids=seq.output_token_ids,
            new_token_ids=new_ids,
            text=text.text if text else "",
            text_delta=delta,
            logprobs=self.logprobs.get(seq.index),
            new_logprobs=list(logprobs) if logprobs is not None else None,
            new_top_logprobs=list(tops) if tops is not None else None,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            spec=spec,
        )

    def output(self, seqs: Seq[Sequence], comps: list[CompletionOutput], finished: bool) -> RequestOutput:
        """``seqs``: the request's sequences the scheduler still tracks."""
        first = seqs[0] if seqs else None
        times = self.times
        if first is not None:
            times.first_scheduled_time = first.first_scheduled_time
            times.first_token_time = first.first_token_time
            # max: a sample that finished early has left ``seqs``, its preemptions not the count
            times.num_preemptions = max(times.num_preemptions, sum(s.num_preemptions for s in seqs))
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=comps,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens if first else 0,
            metrics=times,
        )


def pick_logprobs(
    seq: Sequence, sampled: dict[str, SampledTokens], num_new: int
) -> tuple[list[float] | None, list | None]:
    """The logprobs of this sequence's ``num_new`` new tokens (several after a verification).

    On the step that forks an n > 1 request, the parent's entry holds all n samples and a new
    child's sample is at its own index there.
    """
    own = seq.seq_id in sampled
    st = sampled[seq.seq_id] if own else sampled[seq_id_of(seq.request_id, 0)]
    k = 0 if own else seq.index
    lps = st.logprobs[k : k + num_new] if st.logprobs else None
    tops = st.top_logprobs[k : k + num_new] if st.top_logprobs else None
    return lps, tops
