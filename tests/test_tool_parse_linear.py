"""The tool-call parser is linear in the text (issue 49: a 32 KB call took ~6 s, quadratically, on
the router's event loop), and JSON nested too deep is refused by name or given back as text,
never a RecursionError (a 500).

Linearity is asserted two ways, neither an absolute time: the parser's own count of the
characters its steps looked at (``examined``: a rescan of a growing buffer makes it quadratic),
and the ratio of the best of several timings of a 32 KB call to an 8 KB one (4 when linear, 16
when quadratic). The calls are fed as a model streams them, a few characters at a time, in the
shapes that used to rescan: another key order (held whole until it closes) and arguments given
as a JSON string."""
from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.pdserve.v1 import serving_pb2 as pb
from tool_calling import requests as tool_requests
from tool_calling.formats import HERMES, LLAMA3_JSON
from tool_calling.json_limits import MAX_JSON_DEPTH, JsonDepthError, check_depth, nesting_depth, structure
from tool_calling.parser import ToolCallParser, parse_all


def _args(size: int) -> dict:
    # Many small keys: every character is structure the scanner must look at.
    return {f"k{i}": f"v{i}" for i in range(size // 14)}


SHAPES = {
    "llama3, arguments before the name": (LLAMA3_JSON, lambda a: '{"parameters": %s, "name": "f"}' % json.dumps(a)),
    "llama3, arguments as a string": (LLAMA3_JSON, lambda a: '{"name": "f", "parameters": %s}'
                                      % json.dumps(json.dumps(a))),
    "hermes, arguments before the name": (HERMES, lambda a: '<tool_call>\n{"arguments": %s, "name": "f"}\n</tool_call>'
                                          % json.dumps(a)),
}


def _stream(fmt, text: str, piece: int = 4) -> tuple[ToolCallParser, float]:
    p = ToolCallParser(fmt)
    t0 = time.perf_counter()
    for i in range(0, len(text), piece):
        p.feed(text[i:i + piece])
    p.finish()
    return p, time.perf_counter() - t0


@pytest.mark.parametrize("shape", SHAPES)
def test_a_32kb_call_streams_in_linear_time(shape):
    fmt, make = SHAPES[shape]
    texts = {kb: make(_args(kb * 1024)) for kb in (8, 32)}
    for kb, text in texts.items():
        p, _ = _stream(fmt, text)
        assert len(p.calls) == 1 and p.calls[0].name == "f"
        assert json.loads(p.calls[0].arguments_text) == _args(kb * 1024)
        # Each character looked at a bounded number of times (the old parser: ~len/8 times each).
        assert p.examined <= 2 * len(text), (kb, p.examined, len(text))
    best = {kb: min(_stream(fmt, text)[1] for _ in range(5)) for kb, text in texts.items()}
    ratio = best[32] / best[8]
    assert ratio < 8, f"32 KB took {ratio:.1f}x the time of 8 KB (linear: ~4, quadratic: ~16)"


def test_a_whole_answer_of_many_calls_is_linear():
    """A whole answer is fed at once (the non-streaming path): many calls in one tag list and
    in separate tags cost per character, not per character times calls."""
    def answer(n: int) -> str:
        calls = ", ".join('{"name": "f", "arguments": {"a": %d}}' % i for i in range(n))
        return f"<tool_call>[{calls}]</tool_call>" + "".join(
            '<tool_call>{"arguments": {"b": %d}, "name": "g"}</tool_call> and ' % i for i in range(n))

    examined = {}
    for n in (500, 2000):
        text = answer(n)
        p = ToolCallParser(HERMES)
        p.feed(text)
        p.finish()
        assert len(p.calls) == 2 * n and p.content == "and" * n  # the blanks next to calls are dropped
        examined[n] = p.examined / len(text)
    assert examined[2000] < 1.5 * examined[500], examined  # per character: flat, not growing with n


def test_deep_model_output_is_given_back_as_text_not_a_recursion_error():
    """A model writes a call object nested 5000 deep in another key order: held whole, it is
    never handed to json.loads (RecursionError), but given back as text. One nested within
    the limit is still a call."""
    deep = "[" * 5000 + "]" * 5000
    text = '<tool_call>{"arguments": {"x": %s}, "name": "f"}</tool_call>' % deep
    content, calls = parse_all(HERMES, text)
    assert calls == [] and content == text
    ok = "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2)
    content, calls = parse_all(HERMES, '<tool_call>{"arguments": {"x": %s}, "name": "f"}</tool_call>' % ok)
    assert [c.name for c in calls] == ["f"] and json.loads(calls[0].arguments_text) == {"x": json.loads(ok)}


def test_the_depth_is_measured_outside_strings():
    assert nesting_depth('{"a": [1, {"b": "[[[[{{"}], "c": "\\"]]"}') == 3
    assert nesting_depth(b'"just a string"') == 0
    assert nesting_depth("[" * 100 + "]" * 100) == 100
    check_depth("f", "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)  # at the limit: accepted
    with pytest.raises(JsonDepthError, match=f"f nests JSON {MAX_JSON_DEPTH + 1} levels deep; at most {MAX_JSON_DEPTH}"):
        check_depth("f", "{\"a\": " * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1))


# A JSON string, escapes included: the scan structure() replaced (slower on large bodies).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='ab"\\[]{},:\n\u00e9'),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(alphabet='k"\\[{'), inner,
                                                                                  max_size=4), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(_JSON, st.booleans())
def test_the_depth_and_the_values_outside_strings_match_a_parse(value, ascii_only):
    """The split scan against what parsing says: quotes, backslashes and brackets inside keys and
    strings (escaped as json.dumps escapes them) never count, whatever the escaping."""
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert nesting_depth(text) == _depth(value)
    rest = structure(text)
    assert b'"' not in rest and b"\\" not in rest
    assert rest == _STRING.sub(b"", text.encode())  # what the old scan (a regex over the strings) left


@pytest.mark.parametrize("where", ["arguments", "parameters"])
def test_a_deeply_nested_grpc_call_is_refused_naming_the_depth_limit(where):
    """Raw gRPC bytes (what protobuf accepts: a string of JSON 100,000 levels deep) used to
    raise RecursionError in json.loads, a 500. Now the field and the limit are named (the router
    makes a ToolRequestError INVALID_ARGUMENT / HTTP 400)."""
    deep = "[" * 100_000 + "]" * 100_000
    msg = pb.ChatPrompt.FromString(pb.ChatPrompt(
        messages=[pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c", name="f", arguments=deep)])
                  if where == "arguments" else pb.ChatMessage(role="user", content="hi")],
        tools=[pb.Tool(name="f", parameters=deep if where == "parameters" else "")]).SerializeToString())
    field = "chat.messages[0].tool_calls[0].arguments" if where == "arguments" else "chat.tools[0].parameters"
    with pytest.raises(tool_requests.ToolRequestError) as err:
        tool_requests.template_messages(msg)
        tool_requests.template_tools(msg)
    assert err.value.field == field
    assert f"nests JSON 100000 levels deep; at most {MAX_JSON_DEPTH} are accepted (the JSON depth limit)" \
        in str(err.value)
