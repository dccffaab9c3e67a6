"""OpenAI's request and response shapes, and their translation to and from the router's own
``GenerateRequest`` / ``GenerateResponse``. No I/O: ``router/http_routes.py`` serves them.

Requests are pydantic models so that a malformed body is refused with a 400 naming the field,
as OpenAI does. Fields OpenAI defines but pdserve cannot honour (tools, logit_bias, echo, ...)
are refused by name instead of silently ignored: a client that sends them expects an effect.
pdserve's own knobs arrive as extra body fields, the way vLLM takes its extras
(``extra_body={"slo_class": "interactive", "top_k": 20}`` in the official client).

What is kept from OpenAI's defaults on purpose: a chat completion without ``max_tokens`` may
use the rest of the context (the router fills it in once it knows the prompt's length), a text
completion defaults to 16 tokens.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from protos.pdserve.v1 import serving_pb2 as pb
from tokens.sampling_params import SamplingParams

# OpenAI's finish reasons, from ours. "abort" and "error" are not OpenAI's but vLLM returns
# "abort" too: a client that cancelled sees why its text stopped.
FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
    pb.FINISH_REASON_UNSPECIFIED: None,
}
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs
UINT32_MAX = (1 << 32) - 1  # token ids and counts travel as uint32 in serving.proto
INT32_MAX = (1 << 31) - 1


def _utf8(value: str) -> str:
    # JSON may escape a lone surrogate ("\ud800"), which no UTF-8 string (and so no protobuf
    # string field) can hold: refuse it here, where the error can name the field.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid UTF-8: lone surrogate {value[e.start]!r} at character {e.start}") from None
    return value


def _token_ids(ids: list[int]) -> list[int]:
    bad = [t for t in ids if not 0 <= t <= UINT32_MAX]
    if bad:
        raise ValueError(f"token ids must be in [0, {UINT32_MAX}], got {bad[:5]}")
    return ids


Text = Annotated[str, AfterValidator(_utf8)]
TokenIds = Annotated[list[int], AfterValidator(_token_ids)]


class UnsupportedError(ValueError):
    """A request field pdserve does not implement: answered with 400 naming the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    """Fields both endpoints share, OpenAI's and pdserve's extras."""

    # allow_inf_nan=False: NaN passes range checks (every comparison is False); refuse it by name.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: Text = ""
    n: int = Field(1, ge=1, le=SamplingParams.MAX_N)
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=1 << 64)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    logit_bias: dict[str, float] | None = None
    # pdserve's extras (vLLM names where vLLM has the same knob)
    top_k: int = Field(0, ge=-1, le=INT32_MAX)
    min_p: float = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0, le=UINT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    slo_class: Literal["interactive", "standard", "batch", "relaxed"] | None = None
    session_id: Text | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and len(v) > SamplingParams.MAX_STOP:
            raise ValueError(f"at most {SamplingParams.MAX_STOP} stop sequences, got {len(v)}")
        for s in [v] if isinstance(v, str) else v or []:
            if len(s) > SamplingParams.MAX_STOP_CHARS:
                raise ValueError(f"stop sequences may have at most {SamplingParams.MAX_STOP_CHARS} characters, "
                                 f"got one of {len(s)}")
        return v

    def _refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise UnsupportedError("logit_bias", "logit_bias is not supported by pdserve")

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> pb.SamplingParams:
        s = pb.SamplingParams(n=self.n, top_k=self.top_k, min_p=self.min_p, min_tokens=self.min_tokens,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              stop=self.stop_list, stop_token_ids=self.stop_token_ids or [],
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              ignore_eos=self.ignore_eos)
        if max_tokens is not None:
            s.max_tokens = max_tokens
        if self.temperature is not None:
            s.temperature = self.temperature
        if self.top_p is not None:
            s.top_p = self.top_p
        if self.repetition_penalty is not None:
            s.repetition_penalty = self.repetition_penalty
        if self.seed is not None:
            s.seed = self.seed
        if logprobs is not None:
            s.logprobs = logprobs
        return s

    def _request(self, sampling: pb.SamplingParams, request_id: str) -> pb.GenerateRequest:
        req = pb.GenerateRequest(model=self.model, request_id=request_id, sampling=sampling,
                                 session_id=self.session_id or "")
        if self.slo_class is not None:
            req.slo_class = pb.SloClass.Value(f"SLO_CLASS_{self.slo_class.upper()}")
        return req


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Text
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

    def text(self, i: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text":
                raise UnsupportedError(f"messages[{i}].content",
                                       f"content parts of type {part.type!r} are not supported (text only)")
            out.append(part.text or "")
        return "".join(out)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def to_generate(self, request_id: str) -> pb.GenerateRequest:
        self._refuse_unsupported()
        if self.tools:
            raise UnsupportedError("tools", "tools / function calling are not supported by pdserve")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise UnsupportedError("response_format", "only response_format {\"type\": \"text\"} is supported")
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedError("top_logprobs", "top_logprobs needs logprobs: true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        req = self._request(self._sampling(max_tokens, logprobs), request_id)
        req.chat.messages.extend(pb.ChatMessage(role=m.role, content=m.text(i)) for i, m in enumerate(self.messages))
        return req


class CompletionRequest(_Common):
    prompt: Text | list[Text] | TokenIds | list[TokenIds]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise UnsupportedError("prompt", "the prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def to_generate(self, request_ids: Sequence[str]) -> list[pb.GenerateRequest]:
        """One router request per prompt (OpenAI's batched prompts)."""
        self._refuse_unsupported()
        if self.echo:
            raise UnsupportedError("echo", "echo is not supported by pdserve")
        if self.suffix:
            raise UnsupportedError("suffix", "suffix (insertion) is not supported by pdserve")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedError("best_of", "best_of must equal n (pdserve returns every sample)")
        out = []
        for prompt, rid in zip(self.prompts(), request_ids, strict=True):
            req = self._request(self._sampling(self.max_tokens if self.max_tokens is not None else 16,
                                               self.logprobs), rid)
            if isinstance(prompt, str):
                req.text = prompt
            else:
                req.tokens.ids.extend(prompt)
            out.append(req)
        return out


# ----------------------------------------------------------------------------- responses
TokenText = Callable[[int], str]


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprobs(entries: Sequence[pb.TokenLogprobs], token_text: TokenText) -> list[dict]:
    def one(tid: int, lp: float) -> dict:
        t = token_text(tid)
        return {"token": t, "logprob": lp, "bytes": list(t.encode())}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t.token_id, t.logprob) for t in e.top]}
            for e in entries]


def completion_logprobs(entries: Sequence[pb.TokenLogprobs], token_text: TokenText, offset: int) -> dict:
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        t = token_text(e.token_id)
        tokens.append(t)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(t.token_id): t.logprob for t in e.top} for e in entries],
            "text_offset": offsets}


@dataclass
class Choice:
    """One sample's output so far."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    text_len: int = 0  # characters already streamed (completion logprobs' text_offset)


@dataclass
class Collected:
    """Everything one router request produced, for a non-streaming answer and for usage."""

    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: pb.Error | None = None

    def choice(self, index: int) -> Choice:
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = Choice(index)
        return c

    def feed(self, resp: pb.GenerateResponse) -> None:
        kind = resp.WhichOneof("kind")
        if kind == "chunk":
            c = self.choice(resp.chunk.index)
            c.text.append(resp.chunk.text)
            c.logprobs.extend(resp.chunk.logprobs)
        elif kind == "complete":
            done = resp.complete
            c = self.choice(done.index)
            c.finish_reason = FINISH_REASONS.get(done.finish_reason)
            c.completion_tokens = done.usage.completion_tokens
            # Every sample's Complete repeats the prompt's figures: count them once.
            self.prompt_tokens = done.usage.prompt_tokens
            self.cached_tokens = max(self.cached_tokens, done.usage.cached_prompt_tokens)
        elif kind == "error":
            self.error = resp.error

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices.values())


def _now() -> int:
    return int(time.time())


def chat_completion_json(rid: str, model: str, collected: Collected, want_logprobs: bool,
                         token_text: TokenText) -> dict:
    choices = []
    for i in sorted(collected.choices):
        c = collected.choices[i]
        choices.append({
            "index": i, "message": {"role": "assistant", "content": "".join(c.text)},
            "logprobs": {"content": chat_logprobs(c.logprobs, token_text)} if want_logprobs else None,
            "finish_reason": c.finish_reason,
        })
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": _now(), "model": model,
            "choices": choices,
            "usage": usage_json(collected.prompt_tokens, collected.completion_tokens, collected.cached_tokens)}


def completion_json(rid: str, model: str, per_prompt: Sequence[Collected], n: int, want_logprobs: bool,
                    token_text: TokenText) -> dict:
    """Batched prompts: choice index = prompt index * n + sample index, as OpenAI numbers them."""
    choices = []
    for p, collected in enumerate(per_prompt):
        for i in sorted(collected.choices):
            c = collected.choices[i]
            choices.append({
                "index": p * n + i, "text": "".join(c.text),
                "logprobs": completion_logprobs(c.logprobs, token_text, 0) if want_logprobs else None,
                "finish_reason": c.finish_reason,
            })
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": _now(), "model": model,
            "choices": choices,
            "usage": usage_json(sum(c.prompt_tokens for c in per_prompt),
                                sum(c.completion_tokens for c in per_prompt),
                                sum(c.cached_tokens for c in per_prompt))}


def _stream_chunk(id_: str, obj: str, created: int, model: str, choices: list[dict], include_usage: bool) -> dict:
    out = {"id": id_, "object": obj, "created": created, "model": model, "choices": choices}
    if include_usage:  # OpenAI: with include_usage, every chunk but the last has "usage": null
        out["usage"] = None
    return out


class ChatStream:
    """GenerateResponses -> chat.completion.chunk objects (dicts), in OpenAI's order: each
    choice's first chunk carries the role, content deltas follow, a last chunk per choice
    carries its finish reason, and with include_usage a final chunk with no choices carries
    the usage (every earlier chunk then has "usage": null)."""

    def __init__(self, rid: str, model: str, want_logprobs: bool, include_usage: bool,
                 token_text: TokenText) -> None:
        self.id = f"chatcmpl-{rid}"
        self.model = model
        self.created = _now()
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.token_text = token_text
        self.collected = Collected()
        self._started: set[int] = set()

    def _chunk(self, choices: list[dict]) -> dict:
        return _stream_chunk(self.id, "chat.completion.chunk", self.created, self.model, choices, self.include_usage)

    def feed(self, resp: pb.GenerateResponse) -> list[dict]:
        self.collected.feed(resp)
        kind = resp.WhichOneof("kind")
        out: list[dict] = []
        if kind == "chunk":
            ch = resp.chunk
            delta: dict[str, Any] = {"content": ch.text}
            if ch.index not in self._started:
                self._started.add(ch.index)
                delta = {"role": "assistant", **delta}
            lp = {"content": chat_logprobs(ch.logprobs, self.token_text)} if self.want_logprobs else None
            out.append(self._chunk([{"index": ch.index, "delta": delta, "logprobs": lp, "finish_reason": None}]))
        elif kind == "complete":
            c = self.collected.choices[resp.complete.index]
            delta = {} if resp.complete.index in self._started else {"role": "assistant", "content": ""}
            self._started.add(resp.complete.index)
            out.append(self._chunk([{"index": c.index, "delta": delta, "logprobs": None,
                                     "finish_reason": c.finish_reason}]))
        return out

    def usage_chunk(self) -> dict:
        c = self.collected
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [], "usage": usage_json(c.prompt_tokens, c.completion_tokens, c.cached_tokens)}


class CompletionStream:
    """GenerateResponses of one prompt (of a batch) -> text_completion chunk objects."""

    def __init__(self, rid: str, model: str, prompt_index: int, n: int, want_logprobs: bool,
                 include_usage: bool, token_text: TokenText, created: int | None = None) -> None:
        self.id = f"cmpl-{rid}"
        self.model = model
        self.created = created if created is not None else _now()
        self.base = prompt_index * n
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.token_text = token_text
        self.collected = Collected()

    def _chunk(self, choice: dict) -> dict:
        return _stream_chunk(self.id, "text_completion", self.created, self.model, [choice], self.include_usage)

    def feed(self, resp: pb.GenerateResponse) -> list[dict]:
        self.collected.feed(resp)
        kind = resp.WhichOneof("kind")
        if kind == "chunk":
            ch = resp.chunk
            c = self.collected.choices[ch.index]
            lp = completion_logprobs(ch.logprobs, self.token_text, c.text_len) if self.want_logprobs else None
            c.text_len += len(ch.text)
            return [self._chunk({"index": self.base + ch.index, "text": ch.text, "logprobs": lp,
                                 "finish_reason": None})]
        if kind == "complete":
            c = self.collected.choices[resp.complete.index]
            return [self._chunk({"index": self.base + c.index, "text": "", "logprobs": None,
                                 "finish_reason": c.finish_reason})]
        return []


def completion_usage_chunk(rid: str, model: str, created: int, per_prompt: Sequence[Collected]) -> dict:
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model, "choices": [],
            "usage": usage_json(sum(c.prompt_tokens for c in per_prompt),
                                sum(c.completion_tokens for c in per_prompt),
                                sum(c.cached_tokens for c in per_prompt))}


def error_json(message: str, type_: str, code: str | int | None = None, param: str | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
