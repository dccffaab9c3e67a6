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

Parsing is linear in the text: every character is scanned once (a call held whole keeps one
scanner across feeds instead of rescanning what it holds, and a head is looked for in at most
``MAX_HEAD_CHARS``), so a 32 KB call costs what four 8 KB calls do. The router parses on its
event loop, chunk by chunk as the text streams; a whole answer is parsed on a worker thread
(frontend/http_routes.py). A call object nested deeper than ``MAX_JSON_DEPTH`` is given back as
text, never handed to ``json.loads`` (which would raise RecursionError).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from tool_calling.formats import ToolFormat
from tool_calling.json_limits import MAX_JSON_DEPTH
from tool_calling.scan import MAX_HEAD_CHARS, NEED, WS, Depth, head, literal, skip_ws

PYTHON_TAG = "<|python_tag|>"  # Llama 3's call marker, should it reach the text
FEED_PIECE = 512  # characters of new text handed to the steps at a time


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


# -- the parser ------------------------------------------------------------------------------
class ToolCallParser:
    """Feed a sample's text as it comes (``feed``), then ``finish``; each returns the events
    the new text settled. ``calls`` and ``content`` are the answer so far. ``examined`` counts
    the characters of buffered text the steps looked at: it stays within a small multiple of
    the text's length (each character is looked at a bounded number of times)."""

    def __init__(self, fmt: ToolFormat, call_id=new_call_id) -> None:
        self.fmt = fmt
        self.calls: list[ParsedCall] = []
        self.examined = 0
        self._text: list[str] = []
        self._new_id = call_id
        self._buf = ""
        self._state = "text"  # text | body | plain (bare JSON formats: the answer was text)
        self._in_list = False
        self._block_start = ""  # the raw text of the current tag, given back if it is no call
        self._block_calls = 0
        self._call: ParsedCall | None = None
        self._depth: Depth | None = None  # a call's arguments, as they stream
        self._closing: Depth | None = None  # the rest of a call's object, after its arguments
        self._obj: Depth | None = None  # a call object in another key order, held until it closes
        self._obj_parts: list[str] = []  # ... and the text of it seen so far
        self._held_ws: list[str] = []  # whitespace that is content only if text follows
        self._lead_ws: list[str] = []  # bare JSON: the blank start of the answer (and its python tag)
        self._tagged = False  # bare JSON: Llama's python tag was read
        self._after_call = False  # text now would follow a call: its leading whitespace goes
        self._keys = (fmt.args_key, "arguments", "parameters")

    @property
    def content(self) -> str:
        return "".join(self._text)

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        # In pieces: each step may copy what is left of the buffer, so the buffer is kept short
        # (a whole answer fed at once stays linear in its length, however many calls it holds).
        for at in range(0, len(text), FEED_PIECE):
            self._buf += text[at:at + FEED_PIECE]
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
            ws = "".join(self._held_ws)
            self._text.append(ws)
            events.append(TextDelta(ws))
        self._held_ws = []
        return events

    # Each step consumes what it can and says whether to go on.
    def _step(self, events: list[Event], final: bool) -> bool:
        self.examined += len(self._buf)
        if self._state == "plain":
            if self._buf:
                self._emit_text(events, self._buf)
                self._buf = ""
            return False
        if self._state == "text":
            return self._text_step(events, final)
        if self._obj is not None:
            return self._object_step(events, final)
        if self._call is not None:
            return self._args_step(events)
        return self._body_step(events, final)

    def _emit_text(self, events: list[Event], text: str) -> None:
        """Content, less the whitespace next to a call: trailing whitespace waits until text
        follows it (a call may come first), leading whitespace after a call is dropped."""
        if self._after_call:
            text = text.lstrip(WS)
            if not text:
                return
            self._after_call, self._held_ws = False, []
        body = text.rstrip(WS)
        if not body:
            if text:
                self._held_ws.append(text)
            return
        out = "".join(self._held_ws) + body
        self._held_ws = [text[len(body):]] if len(body) < len(text) else []
        self._text.append(out)
        events.append(TextDelta(out))

    def _text_step(self, events: list[Event], final: bool) -> bool:
        fmt, buf = self.fmt, self._buf
        if not fmt.open:
            return self._bare_start(final)
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

    def _bare_start(self, final: bool) -> bool:
        """Bare JSON: a call only if the answer starts with one (after blanks and Llama's
        python tag). A blank start is set aside, not rescanned on every feed."""
        buf = self._buf
        lead = buf.lstrip(WS)
        if not self._tagged and lead.startswith(PYTHON_TAG):
            self._tagged = True
            lead = lead[len(PYTHON_TAG):].lstrip(WS)
        elif not self._tagged and lead and PYTHON_TAG.startswith(lead) and not final:
            return False  # the tag may be arriving: at most its length is held
        if not lead:
            if final:  # no call: the blank answer is the text, as it came
                self._buf, self._lead_ws = "".join(self._lead_ws) + buf, []
            else:
                self._lead_ws.append(buf)
                self._buf = ""
            return False
        if lead[0] == "{":
            self._buf, self._state = lead, "body"
        else:
            self._buf, self._state = "".join(self._lead_ws) + buf, "plain"
        self._lead_ws = []
        return True

    def _body_step(self, events: list[Event], final: bool) -> bool:
        """Between calls inside a tag (or in a bare-JSON answer)."""
        fmt, buf = self.fmt, self._buf
        i = skip_ws(buf, 0)
        if fmt.open:
            j = literal(buf, i, fmt.close)
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
        if fmt.open and literal(buf, i, fmt.close) == NEED and not final:
            return False
        return self._not_a_call(events)

    def _call_step(self, events: list[Event], buf: str, final: bool) -> bool:
        found = head(buf, 0, self._keys)
        if found == NEED and not final and len(buf) <= MAX_HEAD_CHARS:
            self._buf = buf
            return False
        if isinstance(found, tuple):
            name, _, after = found
            self._start_call(events, name)
            self._depth = Depth()
            self._buf = buf[after:]
            return True
        # Another key order (no head, or none within MAX_HEAD_CHARS): the whole object, once
        # it closes, scanned as it comes.
        self._obj, self._obj_parts, self._buf = Depth(), [], buf
        return True

    def _object_step(self, events: list[Event], final: bool) -> bool:
        obj, buf = self._obj, self._buf
        end = obj.scan(buf)
        if end is None:
            self._obj_parts.append(buf)
            self._buf = ""
            if not final:
                return False
            self._obj, self._buf = None, "".join(self._obj_parts)
            return self._not_a_call(events)
        text, rest = "".join(self._obj_parts) + buf[:end], buf[end:]
        self._obj, self._obj_parts = None, []
        value = None
        if obj.max_depth <= MAX_JSON_DEPTH:  # deeper would make json.loads raise RecursionError
            try:
                value = json.loads(text)
            except ValueError:
                pass
        key = next((k for k in self._keys if isinstance(value, dict) and k in value), None)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or key is None:
            self._buf = text + rest
            return self._not_a_call(events)
        self._start_call(events, value["name"])
        args = value[key]
        self._add_args(events, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
        self._call, self._after_call = None, True
        self._buf = rest
        return True

    def _start_call(self, events: list[Event], name: str) -> None:
        self._held_ws = []  # whitespace before a call is not content
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
        # The rest of the call object: its closing brace (other keys after the arguments are
        # skipped, so what was scanned is dropped and the scanner kept across feeds).
        if self._closing is None:
            self._closing = Depth(depth=1)
        end = self._closing.scan(buf)
        if end is None:
            self._buf = ""
            return False
        self._call, self._closing, self._buf = None, None, buf[end:]
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
