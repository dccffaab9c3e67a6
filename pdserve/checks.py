"""What the SDK checks before a request is sent: the values serving.proto cannot carry (an
integer outside its field's range, a NaN or an inf, a string that is not UTF-8, a prompt of
the wrong shape), refused with InvalidRequestError naming the field, instead of protobuf's
"Value out of range: -1" or a UnicodeEncodeError. Limits that are the server's to set
(n <= 16, max_tokens against the context, top_p in (0, 1], ...) stay with the server: it
answers them with the same exception.

Structured outputs and tools arrive in OpenAI's and vLLM's shapes and become wire messages
through protos/openai_shapes.py, the module the router's HTTP API reads them with, so the SDK
and HTTP refuse the same shapes with the same field names.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from pdserve.errors import InvalidRequestError
from protos import openai_shapes as shapes
from protos.pdserve.v1 import serving_pb2 as pb

UINT32_MAX = (1 << 32) - 1
INT32_MAX = (1 << 31) - 1
UINT64_MAX = (1 << 64) - 1
FLOAT32_MAX = 3.4028234663852886e38  # larger values arrive as inf

# field -> (lowest, highest) accepted here
INT_FIELDS: dict[str, tuple[int, int]] = {
    "n": (1, UINT32_MAX), "max_tokens": (1, UINT32_MAX), "min_tokens": (0, UINT32_MAX),
    "top_k": (-1, INT32_MAX), "seed": (0, UINT64_MAX), "logprobs": (0, UINT32_MAX),
}
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output")


def invalid(field: str, message: str) -> InvalidRequestError:
    err = InvalidRequestError(grpc.StatusCode.INVALID_ARGUMENT, message)
    err.field = field
    return err


def check_int(field: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool):
        raise invalid(field, f"{field} must be an integer, got {value!r}")
    try:
        value = operator.index(value)  # ints and numpy integers, not floats
    except TypeError:
        raise invalid(field, f"{field} must be an integer, got {value!r}") from None
    if not lo <= value <= hi:
        raise invalid(field, f"{field} must be between {lo} and {hi}, got {value}")
    return value


def check_float(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(field, f"{field} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise invalid(field, f"{field} must be a finite number (a float32 on the wire), got {value}")
    return value


def check_str(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise invalid(field, f"{field} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(field, f"{field} is not valid UTF-8: lone surrogate {value[e.start]!r} "
                             f"at character {e.start}") from None
    return value


def check_sampling(fields: Mapping[str, Any]) -> None:
    """Sampling keywords of ``sampling_message`` (None = unset, not checked)."""
    for name, value in fields.items():
        if value is None:
            continue
        if name in INT_FIELDS:
            check_int(name, value, *INT_FIELDS[name])
        elif name in FLOAT_FIELDS:
            check_float(name, value)
        elif name in BOOL_FIELDS and not isinstance(value, bool):
            raise invalid(name, f"{name} must be true or false, got {value!r}")


def check_stop(stop: Sequence[str] | str) -> list[str]:
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, Sequence):
        raise invalid("stop", f"stop must be a string or a list of strings, got {type(stop).__name__}")
    return [check_str(f"stop[{i}]", s) for i, s in enumerate(items)]


def check_token_ids(field: str, ids: Any) -> list[int]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise invalid(field, f"{field} must be a list of integers, got {type(ids).__name__}")
    return [check_int(f"{field}[{i}]", t, 0, UINT32_MAX) for i, t in enumerate(ids)]


def check_messages(messages: Any) -> list[pb.ChatMessage]:
    """Chat messages (OpenAI's dicts: ``role``, ``content``; an assistant turn's ``tool_calls``
    with or without content; a tool result's ``tool_call_id`` and ``name``) -> wire messages."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise invalid("messages", f"messages must be a list of {{'role', 'content'}} dicts, "
                                  f"got {type(messages).__name__}")
    if not messages:
        raise invalid("messages", "messages is empty: a chat prompt needs at least one message")
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, Mapping) else None
        if not isinstance(m, Mapping) or "role" not in m or ("content" not in m and not calls):
            raise invalid(f"messages[{i}]", f"messages[{i}] must be a dict with 'role' and 'content', got {m!r:.80}")
        content = m.get("content")
        msg = pb.ChatMessage(role=check_str(f"messages[{i}].role", m["role"]),
                             content="" if content is None and calls else check_str(f"messages[{i}].content", content))
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                setattr(msg, key, check_str(f"messages[{i}].{key}", m[key]))
        if calls:
            msg.tool_calls.extend(shaped(shapes.tool_calls_from_openai, calls, f"messages[{i}].tool_calls"))
        out.append(msg)
    return out


def shaped(convert, *args):
    """A protos/openai_shapes.py conversion, its ShapeError as InvalidRequestError."""
    try:
        return convert(*args)
    except shapes.ShapeError as e:
        raise invalid(e.field, str(e)) from None


def structured_message(response_format: Any, structured: Any) -> pb.StructuredOutput | None:
    """``response_format=`` (OpenAI's) or ``structured=`` (vLLM's structured_outputs) -> the
    wire's constraint; both at once is refused naming them."""
    sources = {"response_format": (shaped(shapes.from_response_format, response_format)
                                   if response_format is not None else None),
               "structured": (shaped(shapes.from_structured_outputs, structured, "structured")
                              if structured is not None else None)}
    return shaped(shapes.one_source, sources)


def add_tools(req: pb.GenerateRequest, tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> None:
    """``tools=``, ``tool_choice=``, ``parallel_tool_calls=`` onto a chat request."""
    if req.WhichOneof("prompt") != "chat":
        raise invalid("tools", "tools, tool_choice and parallel_tool_calls need a chat prompt (messages)")
    if tools:
        req.chat.tools.extend(shaped(shapes.tools_from_openai, tools))
    choice = shaped(shapes.tool_choice_from_openai, tool_choice)
    if choice is not None:
        req.chat.tool_choice.CopyFrom(choice)
    if parallel_tool_calls is not None:
        if not isinstance(parallel_tool_calls, bool):
            raise invalid("parallel_tool_calls", f"parallel_tool_calls must be true or false, "
                                                 f"got {parallel_tool_calls!r}")
        req.chat.parallel_tool_calls = parallel_tool_calls
