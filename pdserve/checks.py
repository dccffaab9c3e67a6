"""What the SDK checks before a request is sent: the values serving.proto cannot carry (an
integer outside its field's range, a NaN or an inf, a string that is not UTF-8, a prompt of
the wrong shape), refused with InvalidRequestError naming the field, instead of protobuf's
"Value out of range: -1" or a UnicodeEncodeError. Limits that are the server's to set
(n <= 16, max_tokens against the context, top_p in (0, 1], ...) stay with the server: it
answers them with the same exception.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from pdserve.errors import InvalidRequestError

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


def check_messages(messages: Any) -> list[tuple[str, str]]:
    """Chat messages -> (role, content) pairs."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise invalid("messages", f"messages must be a list of {{'role', 'content'}} dicts, "
                                  f"got {type(messages).__name__}")
    if not messages:
        raise invalid("messages", "messages is empty: a chat prompt needs at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise invalid(f"messages[{i}]", f"messages[{i}] must be a dict with 'role' and 'content', got {m!r:.80}")
        out.append((check_str(f"messages[{i}].role", m["role"]), check_str(f"messages[{i}].content", m["content"])))
    return out
