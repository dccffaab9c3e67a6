"""The small scanners the tool-call parser (tool_calling/parser.py) reads a buffer with: blanks,
literals, a JSON string's end, a call's head, and the bracket depth of a JSON value read piece
by piece. Each either answers, says the buffer ends before the answer is known (``NEED``), or
says no (None). Plain functions over strings, stdlib only.
"""
from __future__ import annotations

import json
import re

NEED = "need"  # the buffer ends before the answer is known


WS = " \t\r\n"


def skip_ws(buf: str, i: int) -> int:
    while i < len(buf) and buf[i] in WS:
        i += 1
    return i


def literal(buf: str, i: int, lit: str) -> int | str | None:
    """Index after ``lit`` at ``i``; NEED if the buffer ends inside a match; None if not."""
    if buf.startswith(lit, i):
        return i + len(lit)
    rest = buf[i:i + len(lit)]  # never more than the literal: a long buffer is not copied
    return NEED if len(rest) < len(lit) and lit.startswith(rest) else None


def string_end(buf: str, i: int) -> int | str | None:
    """``buf[i]`` opens a JSON string: the index after its closing quote, or NEED."""
    if i >= len(buf):
        return NEED
    if buf[i] != '"':
        return None
    j = i + 1
    while j < len(buf):
        c = buf[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return NEED


def head(buf: str, i: int, args_keys: tuple[str, ...]) -> tuple[str, str, int] | str | None:
    """``{"name": "f", "arguments":`` at ``i`` (whitespace allowed between the tokens):
    (name, key, index after the colon), NEED, or None when the object does not start so."""
    steps: list = ["{", '"name"', ":"]
    j = i
    for lit in steps:
        j = skip_ws(buf, j)
        j = literal(buf, j, lit)
        if not isinstance(j, int):
            return j
    j = skip_ws(buf, j)
    end = string_end(buf, j)
    if not isinstance(end, int):
        return end
    try:
        name = json.loads(buf[j:end])
    except ValueError:
        return None
    j = skip_ws(buf, end)
    j = literal(buf, j, ",")
    if not isinstance(j, int):
        return j
    j = skip_ws(buf, j)
    for key in args_keys:
        k = literal(buf, j, f'"{key}"')
        if k == NEED:
            return NEED
        if isinstance(k, int):
            k = skip_ws(buf, k)
            k = literal(buf, k, ":")
            if not isinstance(k, int):
                return k
            k = skip_ws(buf, k)
            if k >= len(buf):
                return NEED
            # Arguments streamed as they come only when they are JSON (not a string of it).
            return (name, key, k) if buf[k] in "{[" else None
    return None


# What the depth scanner stops at: outside strings a quote or a bracket, inside one a quote or
# a backslash. Runs of anything else are skipped by the regex engine, not a Python loop.
_OUTSIDE = re.compile(r'["\[\]{}]')
_INSIDE = re.compile(r'["\\]')
# A call's head ({"name": "f", "arguments":) is looked for in at most this much text: a name is
# at most 64 characters (protos/openai_shapes.py FUNCTION_NAME), the rest is keys and blanks.
# Past it the object is held whole, so the head is never rescanned over a growing buffer.
MAX_HEAD_CHARS = 256


class Depth:
    """Bracket depth of a JSON value read piece by piece, strings and escapes respected; each
    piece is scanned once (``chars`` counts what it scanned). ``max_depth``: the deepest level
    seen."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self.max_depth = depth
        self.in_string = False
        self.escaped = False
        self.started = False
        self.chars = 0

    def scan(self, text: str) -> int | None:
        """Feed ``text``; the index just past the value's end if it ends in ``text``."""
        k, n = 0, len(text)
        self.chars += n
        if self.escaped and n:  # the character after a backslash that ended the last piece
            self.escaped, k = False, 1
        while k < n:
            if self.in_string:
                m = _INSIDE.search(text, k)
                if m is None:
                    return None
                k = m.end()
                if m.group() == "\\":
                    if k >= n:
                        self.escaped = True
                        return None
                    k += 1
                    continue
                self.in_string = False
                if self.depth == 0:
                    return k
                continue
            m = _OUTSIDE.search(text, k)
            if m is None:
                return None
            c, k = m.group(), m.end()
            if c == '"':
                self.in_string, self.started = True, True
            elif c in "{[":
                self.depth += 1
                self.started = True
                self.max_depth = max(self.max_depth, self.depth)
            else:
                self.depth -= 1
                if self.depth == 0:
                    return k
        return None
