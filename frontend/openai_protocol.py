"""OpenAI's request shapes and their translation to the router's own ``GenerateRequest``, and
OpenAI's error body. No I/O: ``frontend/http_routes.py`` serves them; the response shapes are
``frontend/openai_responses.py``.

Requests are pydantic models so that a malformed body is refused with a 400 naming the field,
as OpenAI does. Fields OpenAI defines but pdserve cannot honour (logit_bias, echo, ...) are
refused by name instead of silently ignored: a client that sends them expects an effect.
pdserve's own knobs arrive as extra body fields, the way vLLM takes its extras
(``extra_body={"slo_class": "interactive", "top_k": 20}`` in the official client).

Structured outputs come from exactly one of OpenAI's ``response_format``, vLLM's
``structured_outputs`` object or its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` extras (two at once is a 400 naming both); tools, the
tool choice and the tool turns of the history travel in the chat prompt, and the router turns
them into the template's input and, for ``required`` or a named function, a constraint
(router/validation.py). The shapes are read by protos/openai_shapes.py, which the SDK shares.

What is kept from OpenAI's defaults on purpose: a chat completion without ``max_tokens`` may
use the rest of the context (the router fills it in once it knows the prompt's length), a text
completion defaults to 16 tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from protos import openai_shapes as shapes
from protos.pdserve.v1 import serving_pb2 as pb
from tokens.sampling_params import SamplingParams

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
    # vLLM's: prompt blocks are reused only among requests of the same salt (router/prepare.py).
    cache_salt: Text | None = None
    # Structured outputs: OpenAI's, vLLM's object, vLLM's older extras (one at a time).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None

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

    def _structured(self) -> pb.StructuredOutput | None:
        """The one structured-output constraint the body asks for (None: none)."""
        try:
            sources = {"response_format": (shapes.from_response_format(self.response_format)
                                           if self.response_format is not None else None),
                       "structured_outputs": (shapes.from_structured_outputs(self.structured_outputs)
                                              if self.structured_outputs is not None else None),
                       **shapes.from_guided(self.model_dump(include=set(shapes.GUIDED) | set(shapes.GUIDED_REFUSED)))}
            return shapes.one_source(sources)
        except shapes.ShapeError as e:
            raise UnsupportedError(e.field, str(e)) from None

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
        structured = self._structured()
        if structured is not None:
            s.structured.CopyFrom(structured)
        return s

    def _request(self, sampling: pb.SamplingParams, request_id: str) -> pb.GenerateRequest:
        req = pb.GenerateRequest(model=self.model, request_id=request_id, sampling=sampling,
                                 session_id=self.session_id or "", cache_salt=self.cache_salt or "")
        if self.slo_class is not None:
            req.slo_class = pb.SloClass.Value(f"SLO_CLASS_{self.slo_class.upper()}")
        return req


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Text | None = None


# The roles OpenAI's chat API takes (its deprecated "function" role aside: tool results come
# as role "tool"). Chat templates render any role name verbatim, so an unknown one would be
# text the model never saw in training rather than an error: refuse it by name.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def _role(value: str) -> str:
    if value not in CHAT_ROLES:
        raise ValueError(f"unknown role {value[:40]!r}; the roles are {', '.join(CHAT_ROLES)}")
    return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Annotated[str, AfterValidator(_role)]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls (multi-turn tool use)
    tool_call_id: Text | None = None  # role "tool": the call it answers

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

    def to_proto(self, i: int) -> pb.ChatMessage:
        msg = pb.ChatMessage(role=self.role, content=self.text(i), tool_call_id=self.tool_call_id or "",
                             name=self.name or "")
        if self.tool_calls:
            try:
                msg.tool_calls.extend(shapes.tool_calls_from_openai(self.tool_calls, f"messages[{i}].tool_calls"))
            except shapes.ShapeError as e:
                raise UnsupportedError(e.field, str(e)) from None
        return msg


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    @property
    def parses_tool_calls(self) -> bool:
        """The answer is read for tool calls: tools given and tool_choice not "none"."""
        return bool(self.tools) and self.tool_choice != "none"

    def to_generate(self, request_id: str) -> pb.GenerateRequest:
        self._refuse_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedError("top_logprobs", "top_logprobs needs logprobs: true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        req = self._request(self._sampling(max_tokens, logprobs), request_id)
        req.chat.messages.extend(m.to_proto(i) for i, m in enumerate(self.messages))
        try:
            if self.tools:
                req.chat.tools.extend(shapes.tools_from_openai(self.tools))
            choice = shapes.tool_choice_from_openai(self.tool_choice)
        except shapes.ShapeError as e:
            raise UnsupportedError(e.field, str(e)) from None
        if choice is not None:
            req.chat.tool_choice.CopyFrom(choice)
        if self.parallel_tool_calls is not None:
            req.chat.parallel_tool_calls = self.parallel_tool_calls
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


def error_json(message: str, type_: str, code: str | int | None = None, param: str | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
