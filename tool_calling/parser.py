"""Tool calls parsed out of a model's text, as it streams: plain strings in, OpenAI-shaped events
out (text deltas, a call's start with its id and name, fragments of its arguments). Torch-free;
the formats are tool_calling/formats.py.

One parser serves both answers: a streaming response sends its events as deltas, a whole
answer feeds the whole text and joins them, so the two never disagree. What it reads, per
format (``open`` / ``close`` the tags, absent for a bare-JSON format)::

    text  <tool_call> {"name": "f", "arguments": {...}} </tool_call>  text  <tool_call> [ {...}, {...} ] </tool_call>
    ^^^^ content      ^^^^^^^^^^^^^^^^^ head ^^^^^^^^^^ ^^ args ^^                     a list of calls in one tag

The head (``{"name": "f", "arguments":`` or ``"parameters":``) names the call as soon as it is
complete; the arguments then stream as the JSON value arrives, its end found by bracket depth
outside strings. A call object in another key order is held until it closes and then sent
whole. Text that may still be the start of a tag is held back, and whitespace next to a call is
dropped (OpenAI's content is the text around the calls). A tag body that is not a call is given
back as text. An unfinished call at the end (max_tokens cut it) keeps what it streamed: the
finish reason says "length".
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from tool_calling.formats import ToolFormat

PYTHON_TAG = "<|python_tag|>"  # Llama 3's call marker, should it reach the text


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgsDelta:
    index: int
    text: str


Event = TextDelta | CallStart | ArgsDelta


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)

    @property
    def arguments_text(self) -> str:
        return "".join(self.arguments)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- small scanners over a buffer ------------------------------------------------------------
_NEED = "need"  # the buffer ends before the answer is known


_WS = " \t\r\n"


def _skip_ws(buf: str, i: int) -> int:
    while i < len(buf) and buf[i] in _WS:
        i += 1
    return i


def _literal(buf: str, i: int, lit: str) -> int | str | None:
    """Index after ``lit`` at ``i``; _NEED if the buffer ends inside a match; None if not."""
    end = i + len(lit)
    if buf.startswith(lit, i):
        return end
    return _NEED if lit.startswith(buf[i:]) else None


def _string_end(buf: str, i: int) -> int | str | None:
    """``buf[i]`` opens a JSON string: the index after its closing quote, or _NEED."""
    if i >= len(buf):
        return _NEED
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
    return _NEED


def _head(buf: str, i: int, args_keys: tuple[str, ...]) -> tuple[str, str, int] | str | None:
    """``{"name": "f", "arguments":`` at ``i`` (whitespace allowed between the tokens):
    (name, key, index after the colon), _NEED, or None when the object does not start so."""
    steps: list = ["{", '"name"', ":"]
    j = i
    for lit in steps:
        j = _skip_ws(buf, j)
        j = _literal(buf, j, lit)
        if not isinstance(j, int):
            return j
    j = _skip_ws(buf, j)
    end = _string_end(buf, j)
    if not isinstance(end, int):
        return end
    try:
        name = json.loads(buf[j:end])
    except ValueError:
        return None
    j = _skip_ws(buf, end)
    j = _literal(buf, j, ",")
    if not isinstance(j, int):
        return j
    j = _skip_ws(buf, j)
    for key in args_keys:
        k = _literal(buf, j, f'"{key}"')
        if k == _NEED:
            return _NEED
        if isinstance(k, int):
            k = _skip_ws(buf, k)
            k = _literal(buf, k, ":")
            if not isinstance(k, int):
                return k
            k = _skip_ws(buf, k)
            if k >= len(buf):
                return _NEED
            # Arguments streamed as they come only when they are JSON (not a string of it).
            return (name, key, k) if buf[k] in "{[" else None
    return None


class _Depth:
    """Bracket depth of a JSON value read piece by piece, strings and escapes respected."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False

    def scan(self, text: str) -> int | None:
        """Feed ``text``; the index just past the value's end if it ends in ``text``."""
        for k, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return k + 1
                continue
            if c == '"':
                self.in_string, self.started = True, True
            elif c in "{[":
                self.depth += 1
                self.started = True
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return k + 1
        return None


# -- the parser ------------------------------------------------------------------------------
class ToolCallParser:
    """Feed a sample's text as it comes (``feed``), then ``finish``; each returns the events
    the new text settled. ``calls`` and ``content`` are the answer so far."""

    def __init__(self, fmt: ToolFormat, call_id=new_call_id) -> None:
        self.fmt = fmt
        self.calls: list[ParsedCall] = []
        self._text: list[str] = []
        self._new_id = call_id
        self._buf = ""
        self._state = "text"  # text | body | plain (bare JSON formats: the answer was text)
        self._in_list = False
        self._block_start = ""  # the raw text of the current tag, given back if it is no call
        self._block_calls = 0
        self._call: ParsedCall | None = None
        self._depth: _Depth | None = None
        self._held_ws = ""  # whitespace that is content only if text follows
        self._after_call = False  # text now would follow a call: its leading whitespace goes
        self._keys = (fmt.args_key, "arguments", "parameters")

    @property
    def content(self) -> str:
        return "".join(self._text)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        while self._step(events, final=True):
            pass
        if self._state == "body":
            if self._call is None and not self._block_calls and self.fmt.open:
                self._emit_text(events, self._block_start + self._buf)  # a tag that held no call
        else:
            self._emit_text(events, self._buf)
        self._buf = ""
        if self._held_ws and not self.calls:  # no call: the text is the whole answer, as it came
            self._text.append(self._held_ws)
            events.append(TextDelta(self._held_ws))
        self._held_ws = ""
        return events

    # Each step consumes what it can and says whether to go on.
    def _step(self, events: list[Event], final: bool) -> bool:
        if self._state == "plain":
            if self._buf:
                self._emit_text(events, self._buf)
                self._buf = ""
            return False
        if self._state == "text":
            return self._text_step(events, final)
        if self._call is not None:
            return self._args_step(events)
        return self._body_step(events, final)

    def _emit_text(self, events: list[Event], text: str) -> None:
        """Content, less the whitespace next to a call: trailing whitespace waits until text
        follows it (a call may come first), leading whitespace after a call is dropped."""
        if self._after_call:
            text = text.lstrip(_WS)
            if not text:
                return
            self._after_call, self._held_ws = False, ""
        body = text.rstrip(_WS)
        if not body:
            self._held_ws += text
            return
        out = self._held_ws + body
        self._held_ws = text[len(body):]
        self._text.append(out)
        events.append(TextDelta(out))

    def _text_step(self, events: list[Event], final: bool) -> bool:
        fmt, buf = self.fmt, self._buf
        if not fmt.open:  # bare JSON: a call only if the answer starts with one
            lead = buf.lstrip(_WS)
            if lead.startswith(PYTHON_TAG):
                lead = lead[len(PYTHON_TAG):].lstrip(_WS)
            elif PYTHON_TAG.startswith(lead) and not final:
                return False
            if not lead:
                return False
            self._buf = lead if lead[0] == "{" else buf
            self._state = "body" if lead[0] == "{" else "plain"
            return True
        at = buf.find(fmt.open)
        if at >= 0:
            self._emit_text(events, buf[:at])
            self._buf = buf[at + len(fmt.open):]
            self._state, self._block_start, self._block_calls, self._in_list = "body", fmt.open, 0, False
            return True
        keep = 0 if final else _partial_suffix(buf, fmt.open)
        self._emit_text(events, buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _body_step(self, events: list[Event], final: bool) -> bool:
        """Between calls inside a tag (or in a bare-JSON answer)."""
        fmt, buf = self.fmt, self._buf
        i = _skip_ws(buf, 0)
        if fmt.open:
            j = _literal(buf, i, fmt.close)
            if isinstance(j, int):
                self._buf = buf[j:]
                self._state = "text"
                self._after_call = self._after_call or self._block_calls > 0
                return True
        if i >= len(buf):
            self._buf = buf[i:]
            return False
        c = buf[i]
        if fmt.lists and c == "[" and not self._in_list:
            self._in_list, self._buf = True, buf[i + 1:]
            return True
        if (self._in_list and c in ",]") or (not fmt.open and c == ";"):
            self._in_list = self._in_list and c == ","
            self._buf = buf[i + 1:]
            return True
        if c == "{":
            return self._call_step(events, buf[i:], final)
        if fmt.open and _literal(buf, i, fmt.close) == _NEED and not final:
            return False
        return self._not_a_call(events)

    def _call_step(self, events: list[Event], buf: str, final: bool) -> bool:
        head = _head(buf, 0, self._keys)
        if head == _NEED and not final:
            self._buf = buf
            return False
        if isinstance(head, tuple):
            name, _, after = head
            self._start_call(events, name)
            self._depth = _Depth()
            self._buf = buf[after:]
            return True
        # Another key order (or no head): the whole object, once it closes.
        end = _Depth().scan(buf)
        if end is None:
            if final:
                return self._not_a_call(events)
            self._buf = buf
            return False
        try:
            obj = json.loads(buf[:end])
        except ValueError:
            obj = None
        key = next((k for k in self._keys if isinstance(obj, dict) and k in obj), None)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or key is None:
            return self._not_a_call(events)
        self._start_call(events, obj["name"])
        args = obj[key]
        self._add_args(events, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
        self._call, self._after_call = None, True
        self._buf = buf[end:]
        return True

    def _start_call(self, events: list[Event], name: str) -> None:
        self._held_ws = ""  # whitespace before a call is not content
        call = ParsedCall(self._new_id(), name)
        self.calls.append(call)
        self._call = call
        self._block_calls += 1
        events.append(CallStart(len(self.calls) - 1, call.id, name))

    def _add_args(self, events: list[Event], text: str) -> None:
        if text and self._call is not None:
            self._call.arguments.append(text)
            events.append(ArgsDelta(len(self.calls) - 1, text))

    def _args_step(self, events: list[Event]) -> bool:
        """Inside a call's arguments, then up to the end of its object."""
        depth, buf = self._depth, self._buf
        if depth is not None:
            if not depth.started:
                buf = buf.lstrip(" \t\r\n")
            end = depth.scan(buf)
            if end is None:
                self._add_args(events, buf)
                self._buf = ""
                return False
            self._add_args(events, buf[:end])
            self._depth, self._buf = None, buf[end:]
            buf = self._buf
        # The rest of the call object: its closing brace (other keys after the arguments skipped).
        closing = _Depth()
        closing.depth = 1
        end = closing.scan(buf)
        if end is None:
            return False
        self._call, self._buf = None, buf[end:]
        self._after_call = True
        return True

    def _not_a_call(self, events: list[Event]) -> bool:
        """The tag's body is not a call: it and the rest of the tag become text."""
        rest = self._buf
        if self.fmt.open:
            at = rest.find(self.fmt.close)
            upto = len(rest) if at < 0 else at + len(self.fmt.close)
        else:
            upto = len(rest)
        text = (self._block_start if not self._block_calls else "") + rest[:upto]
        self._state = "text" if self.fmt.open else "plain"
        self._buf = rest[upto:]
        self._emit_text(events, text)
        return True


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse_all(fmt: ToolFormat, text: str, call_id=new_call_id) -> tuple[str, list[ParsedCall]]:
    """A whole answer: (content, calls)."""
    p = ToolCallParser(fmt, call_id)
    p.feed(text)
    p.finish()
    return p.content, p.calls
