"""OpenAI's response shapes, from the router's ``GenerateResponse`` messages: a whole answer
(``chat_completion_json``, ``completion_json``) or a stream of chunks (``ChatStream``,
``CompletionStream``), usage and logprobs as OpenAI spells them. No I/O:
``frontend/http_routes.py`` serves them; the requests are ``frontend/openai_protocol.py``.

A chat request with tools (tool_choice not "none") has its text read for tool calls in the
model's format (tool_calling/parser.py): a whole answer's message gets ``tool_calls`` and the text
around them as ``content``; a stream sends OpenAI's deltas, the first of each call with its id,
type and name, then fragments of its arguments. A sample that stopped after calling tools ends
with finish_reason "tool_calls".
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from protos.pdserve.v1 import serving_pb2 as pb
from tool_calling.formats import ToolFormat
from tool_calling.parser import ArgsDelta, CallStart, Event, ParsedCall, TextDelta, ToolCallParser, parse_all

# OpenAI's finish reasons, from ours. "abort" and "error" are not OpenAI's but vLLM returns
# "abort" too: a client that cancelled sees why its text stopped.
FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
    pb.FINISH_REASON_UNSPECIFIED: None,
}
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


def tool_calls_json(calls: Sequence[ParsedCall]) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_text}}
            for c in calls]


def _finish(reason: str | None, calls: bool) -> str | None:
    # OpenAI's "tool_calls": the sample stopped by itself after calling; one cut by max_tokens
    # stays "length" (its last call may be incomplete).
    return "tool_calls" if calls and reason == "stop" else reason


def chat_message(text: str, tool_format: ToolFormat | None) -> tuple[dict, bool]:
    """The assistant message of one answer, and whether it called tools."""
    if tool_format is None:
        return {"role": "assistant", "content": text}, False
    content, calls = parse_all(tool_format, text)
    if not calls:
        return {"role": "assistant", "content": content}, False
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls_json(calls)}, True


def chat_completion_json(rid: str, model: str, collected: Collected, want_logprobs: bool,
                         token_text: TokenText, tool_format: ToolFormat | None = None) -> dict:
    """``tool_format``: read the answers for tool calls in that format (None: plain text)."""
    choices = []
    for i in sorted(collected.choices):
        c = collected.choices[i]
        message, called = chat_message("".join(c.text), tool_format)
        choices.append({
            "index": i, "message": message,
            "logprobs": {"content": chat_logprobs(c.logprobs, token_text)} if want_logprobs else None,
            "finish_reason": _finish(c.finish_reason, called),
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
    the usage (every earlier chunk then has "usage": null). With ``tool_format``, each
    choice's text goes through a tool-call parser: content deltas are the text around the
    calls, and each call is a delta with its id, type and name, then deltas of its arguments."""

    def __init__(self, rid: str, model: str, want_logprobs: bool, include_usage: bool,
                 token_text: TokenText, tool_format: ToolFormat | None = None) -> None:
        self.id = f"chatcmpl-{rid}"
        self.model = model
        self.created = _now()
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.token_text = token_text
        self.tool_format = tool_format
        self.collected = Collected()
        self._started: set[int] = set()
        self._parsers: dict[int, ToolCallParser] = {}

    def _chunk(self, choices: list[dict]) -> dict:
        return _stream_chunk(self.id, "chat.completion.chunk", self.created, self.model, choices, self.include_usage)

    def _delta_chunk(self, index: int, delta: dict, logprobs: dict | None = None) -> dict:
        if index not in self._started:
            self._started.add(index)
            delta = {"role": "assistant", **delta}
        return self._chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}])

    def _parser(self, index: int) -> ToolCallParser:
        p = self._parsers.get(index)
        if p is None:
            p = self._parsers[index] = ToolCallParser(self.tool_format)
        return p

    def _event_chunks(self, index: int, events: list[Event], logprobs: dict | None) -> list[dict]:
        """One chunk per content run and per call delta (clients read tool_calls[0] only)."""
        out, text = [], []
        for e in events + [None]:
            if isinstance(e, TextDelta):
                text.append(e.text)
                continue
            if text:
                out.append(self._delta_chunk(index, {"content": "".join(text)}, logprobs))
                text, logprobs = [], None
            if isinstance(e, CallStart):
                out.append(self._delta_chunk(index, {"tool_calls": [
                    {"index": e.index, "id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}]}))
            elif isinstance(e, ArgsDelta):
                out.append(self._delta_chunk(index, {"tool_calls": [
                    {"index": e.index, "function": {"arguments": e.text}}]}))
        if logprobs is not None:  # text held back (a tag may be starting): the logprobs still go out
            out.append(self._delta_chunk(index, {"content": ""}, logprobs))
        return out

    def feed(self, resp: pb.GenerateResponse) -> list[dict]:
        self.collected.feed(resp)
        kind = resp.WhichOneof("kind")
        out: list[dict] = []
        if kind == "chunk":
            ch = resp.chunk
            lp = {"content": chat_logprobs(ch.logprobs, self.token_text)} if self.want_logprobs else None
            if self.tool_format is None:
                return [self._delta_chunk(ch.index, {"content": ch.text}, lp)]
            return self._event_chunks(ch.index, self._parser(ch.index).feed(ch.text), lp)
        if kind == "complete":
            index = resp.complete.index
            c = self.collected.choices[index]
            called = False
            if self.tool_format is not None:
                parser = self._parser(index)
                out.extend(self._event_chunks(index, parser.finish(), None))
                called = bool(parser.calls)
            delta = {} if index in self._started else {"role": "assistant", "content": ""}
            self._started.add(index)
            out.append(self._chunk([{"index": c.index, "delta": delta, "logprobs": None,
                                     "finish_reason": _finish(c.finish_reason, called)}]))
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

    @classmethod
    def for_prompts(cls, rid: str, model: str, prompts: int, n: int, want_logprobs: bool, include_usage: bool,
                    token_text: TokenText) -> list[CompletionStream]:
        """One encoder per prompt of a batch, all with the same ``created`` (one response)."""
        created = _now()
        return [cls(rid, model, i, n, want_logprobs, include_usage, token_text, created) for i in range(prompts)]

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
