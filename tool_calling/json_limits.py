"""How deep JSON may nest, measured without parsing it (stdlib only).

Python's ``json`` module recurses once per level, so a value nested a thousand levels deep
raises RecursionError, and what handles it (a template's ``tojson``, ``json.dumps``, pydantic)
may recurse too. A client's JSON is therefore measured before anything parses it: tool-call
arguments and parameter schemas of a chat request (tool_calling/requests.py) and the HTTP body
(frontend/http_front.py) deeper than ``MAX_JSON_DEPTH`` are refused with a 400 naming the limit.

The measure runs at C speed: strings are cut out by splitting at their quotes (escape pairs
removed first, so an escaped quote never ends a string), every byte but the brackets is deleted, and the depth is the largest running sum of +1 per opening bracket and
-1 per closing one (``itertools.accumulate`` over a signed-byte view). No JSON schema or call a
model is given needs more than a few dozen levels.
"""
from __future__ import annotations

from itertools import accumulate

MAX_JSON_DEPTH = 64  # levels of arrays and objects in one value (a tool's schema, a call's arguments)

_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
# Opening brackets become +1, closing ones -1, as signed bytes.
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


class JsonDepthError(ValueError):
    """JSON nested deeper than the limit; ``field`` names where it was."""

    def __init__(self, field: str, depth: int, limit: int) -> None:
        super().__init__(f"{field} nests JSON {depth} levels deep; at most {limit} are accepted (the JSON depth "
                         f"limit)")
        self.field, self.depth, self.limit = field, depth, limit


def structure(data: str | bytes) -> bytes:
    """``data`` with its strings cut out (what is left: brackets, separators, numbers and
    literals). An unterminated string at the end is cut to the end."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if b'"' not in raw:
        return raw
    # A backslash only appears inside strings and escapes the byte after it; pairing a run of
    # backslashes left to right is how JSON reads them, so once the pairs are gone a remaining
    # backslash-quote is an escaped quote. Then every quote left opens or closes a string: the
    # even pieces between them are outside strings, the odd ones inside (an odd count of quotes
    # leaves the last string unterminated, and the cut runs to the end). A regular expression
    # over the strings did the same work in its engine 1.4x slower (13.7 against 9.9 ms on a
    # 1.5 MB chat body with escapes), and the front door measures every body before admitting it.
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    return b"".join(raw.split(b'"')[0::2])


def depth_of_structure(rest: bytes) -> int:
    """The nesting depth of ``structure()``'s result (0 for a scalar)."""
    brackets = rest.translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    steps = memoryview(brackets.translate(_STEPS)).cast("b")
    return max(0, max(accumulate(steps)))


def nesting_depth(data: str | bytes) -> int:
    """How many levels of arrays and objects ``data`` nests (brackets inside strings not counted)."""
    return depth_of_structure(structure(data))


def check_depth(field: str, data: str | bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """JsonDepthError naming ``field`` and the limit when ``data`` nests deeper than ``limit``."""
    if data.count("[" if isinstance(data, str) else b"[") + data.count("{" if isinstance(data, str) else b"{") \
            <= limit:  # cannot nest deeper than it has brackets: most values stop here
        return
    depth = nesting_depth(data)
    if depth > limit:
        raise JsonDepthError(field, depth, limit)
