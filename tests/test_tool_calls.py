"""Tool calls on plain strings: each format's parser (tool_calling/parser.py) fed whole and in
every split, the events of a stream equal to the whole answer's; the format read from a chat
template, the tool turns rendered through it (tool_calling/formats.py, router/tokenizer.py), the
constraint that keeps calls valid; OpenAI's and vLLM's shapes to wire messages
(protos/openai_shapes.py)."""
from __future__ import annotations

import json
import shutil
from itertools import count

import pytest

from protos import openai_shapes as shapes
from protos.pdserve.v1 import serving_pb2 as pb
from tool_calling.formats import HERMES, LLAMA3_JSON, SMOLLM2, call_constraint, detect_format, template_inputs
from tool_calling.parser import ArgsDelta, CallStart, TextDelta, ToolCallParser, parse_all


def ids():
    c = count()
    return lambda: f"call_{next(c)}"


def calls_of(fmt, text):
    content, calls = parse_all(fmt, text, ids())
    return content, [(c.name, json.loads(c.arguments_text)) for c in calls]


def streamed(fmt, pieces):
    """Events of a stream fed ``pieces``, folded the way an OpenAI client folds deltas."""
    p = ToolCallParser(fmt, ids())
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    content, calls = "", {}
    for e in events:
        if isinstance(e, TextDelta):
            content += e.text
        elif isinstance(e, CallStart):
            assert e.index not in calls
            calls[e.index] = [e.id, e.name, ""]
        else:
            assert isinstance(e, ArgsDelta)
            calls[e.index][2] += e.text
    return content, [(n, json.loads(a)) for _, n, a in (calls[i] for i in sorted(calls))], events


HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "a \\"quoted\\" }{ ]"}}\n</tool_call>')
CASES = [
    (HERMES, HERMES_TWO, "Let me check.",
     [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {"tz": 'a "quoted" }{ ]'})]),
    (HERMES, "Paris is sunny today.\n", "Paris is sunny today.\n", []),
    (HERMES, '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>', "", [("f", {"x": 1})]),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', "", [("f", {"x": 2})]),
    (HERMES, "I use <tool_call>tags</tool_call> in prose", "I use <tool_call>tags</tool_call> in prose", []),
    (HERMES, "a < b and <tool_ca", "a < b and <tool_ca", []),
    (SMOLLM2, '<tool_call>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]</tool_call>', "",
     [("f", {"a": 1}), ("g", {})]),
    (SMOLLM2, '<tool_call>[{"name": "f", "arguments": {"a": 1}}]</tool_call>\n<tool_call>[{"name": "g", '
              '"arguments": {"b": "}"}}]</tool_call>', "", [("f", {"a": 1}), ("g", {"b": "}"})]),
    (LLAMA3_JSON, '{"name": "f", "parameters": {"q": "x"}}', "", [("f", {"q": "x"})]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"n": 1}}', "",
     [("f", {}), ("g", {"n": 1})]),
    (LLAMA3_JSON, 'The answer is {"name": 1}', 'The answer is {"name": 1}', []),
    (LLAMA3_JSON, '{"answer": 42}', '{"answer": 42}', []),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_whole_answers_parse(fmt, text, content, calls):
    assert calls_of(fmt, text) == (content, calls)


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_streams_in_every_split_give_the_whole_answer(fmt, text, content, calls):
    for size in (1, 2, 3, 7):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        got_content, got_calls, events = streamed(fmt, pieces)
        assert (got_content, got_calls) == (content, calls), size
    # Each call: its start (id and name) comes before any fragment of its arguments.
    seen = set()
    for e in events:
        if isinstance(e, CallStart):
            seen.add(e.index)
        elif isinstance(e, ArgsDelta):
            assert e.index in seen


def test_arguments_stream_before_the_call_ends():
    p = ToolCallParser(HERMES, ids())
    assert p.feed("<tool_call>\n{\"name\": \"get_wea") == []
    assert p.feed("ther\", \"arguments\": {\"ci") == [CallStart(0, "call_0", "get_weather"), ArgsDelta(0, '{"ci')]
    assert p.feed('ty": "Paris"}}\n</tool_call>') == [ArgsDelta(0, 'ty": "Paris"}')]
    assert p.finish() == []
    assert p.calls[0].arguments_text == '{"city": "Paris"}'


def test_a_call_cut_by_max_tokens_keeps_what_it_streamed():
    p = ToolCallParser(HERMES, ids())
    p.feed('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2')
    p.finish()
    assert [(c.name, c.arguments_text) for c in p.calls] == [("f", '{"a": [1, 2')]


def test_format_from_the_template():
    assert detect_format("{% for m in messages %}<tool_call>{% endfor %}") is HERMES
    assert detect_format("{{- '<|python_tag|>' }}{% if tools %}{% endif %}") is LLAMA3_JSON
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is SMOLLM2
    assert detect_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}") is None
    assert detect_format(None) is None


TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
         {"name": "now", "description": "", "parameters": None}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "call_1", "name": "get_weather"},
]


def test_smollm2_renders_tools_and_tool_turns_into_its_messages():
    msgs, tools = template_inputs(SMOLLM2, [{"role": "system", "content": "Be brief."}, *HISTORY], TOOLS)
    assert tools is None
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    assert msgs[3]["content"] == '<tool_response>\n{"sky": "clear"}\n</tool_response>'
    # What the model is shown as its own past call parses back to it.
    assert calls_of(SMOLLM2, msgs[2]["content"])[1] == [("get_weather", {"city": "Paris"})]


def test_templates_with_tools_get_them_in_openai_shape():
    msgs, tools = template_inputs(HERMES, HISTORY, TOOLS)
    assert msgs == HISTORY
    assert tools[0] == {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                         "parameters": TOOLS[0]["parameters"]}}
    assert tools[1]["function"] == {"name": "now", "parameters": {"type": "object", "properties": {}}}


def test_the_constraint_names_each_function_in_the_models_format():
    required = json.loads(call_constraint(HERMES, TOOLS, required=True, parallel=True).spec)
    assert required["at_least_one"] and not required["stop_after_first"]
    assert required["triggers"] == ["<tool_call>"]
    assert required["structures"][0] == {"begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
                                         "schema": TOOLS[0]["parameters"], "end": "}\n</tool_call>"}
    assert required["structures"][1]["schema"] == {"type": "object", "properties": {}, "additionalProperties": False}
    named = json.loads(call_constraint(SMOLLM2, TOOLS, required=False, parallel=True, function="now").spec)
    assert [s["begin"] for s in named["structures"]] == ['<tool_call>[{"name": "now", "arguments": ']
    assert named["at_least_one"] and named["stop_after_first"]
    auto = json.loads(call_constraint(HERMES, TOOLS, required=False, parallel=False).spec)
    assert not auto["at_least_one"] and auto["stop_after_first"]
    assert call_constraint(LLAMA3_JSON, TOOLS, required=False, parallel=True) is None  # no tag to trigger on
    one = json.loads(call_constraint(LLAMA3_JSON, TOOLS, required=True, parallel=True).spec)
    assert one["stop_after_first"]  # Llama 3 calls one function per answer
    # A constrained call, with any arguments the schema allows, parses back in its format.
    for fmt in (HERMES, SMOLLM2, LLAMA3_JSON):
        st = json.loads(call_constraint(fmt, TOOLS, required=True, parallel=True).spec)["structures"][0]
        text = st["begin"] + '{"city": "Oslo"}' + st["end"]
        assert calls_of(fmt, text) == ("", [("get_weather", {"city": "Oslo"})]), fmt.name


@pytest.fixture(scope="module")
def tokenizer_with(tmp_path_factory, tok_dir):
    from router.tokenizer import PromptTokenizer

    def make(template: str | None):
        d = tmp_path_factory.mktemp("tok")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f"{tok_dir}/{name}", d / name)
        if template is not None:
            (d / "chat_template.jinja").write_text(template)
        return PromptTokenizer(d)
    return make


# A Hermes-style template in the shape of Qwen2.5's: tools in the system turn, calls in tags.
QWEN_LIKE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_the_tokenizer_renders_tools_through_the_models_template(tokenizer_with, tok_dir):
    from router.tokenizer import PromptTokenizer

    smol = PromptTokenizer(tok_dir)
    assert smol.tool_format is SMOLLM2
    text = smol.render_chat(HISTORY, tools=TOOLS)
    assert "<|im_start|>system\nYou can call functions" in text  # not SmolLM2's default system turn
    assert '<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>' \
        in text
    assert text.endswith("<tool_response>\n{\"sky\": \"clear\"}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    qwen = tokenizer_with(QWEN_LIKE)
    assert qwen.tool_format is HERMES
    text = qwen.render_chat(HISTORY, tools=TOOLS)
    assert '{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert qwen.render_chat(HISTORY[:1]) == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"


# A template in the shape of Llama 3.1's: tools as indented JSON in the first user turn, a call
# as bare JSON with "parameters", tool results as "ipython" turns.
LLAMA_LIKE = """{{- bos_token }}
{%- for message in messages %}
{%- if message.role == "user" and loop.first and tools %}<|start_header_id|>user<|end_header_id|>

Given the following functions, respond with a JSON function call.
{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.role == "assistant" and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{%- set tc = message.tool_calls[0].function %}
{"name": "{{ tc.name }}", "parameters": {{ tc.arguments | tojson }}}<|eot_id|>
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


def test_a_llama3_template_gets_tools_and_its_calls_parse_back(tokenizer_with):
    llama = tokenizer_with(LLAMA_LIKE)
    assert llama.tool_format is LLAMA3_JSON
    text = llama.render_chat(HISTORY, tools=TOOLS)
    assert '    "type": "function",\n    "function": {\n        "name": "get_weather"' in text
    past = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert past in text and "<|start_header_id|>ipython<|end_header_id|>" in text
    assert calls_of(LLAMA3_JSON, past) == ("", [("get_weather", {"city": "Paris"})])


# -- OpenAI's and vLLM's shapes --------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_response_format_and_vllm_extras_become_one_constraint():
    assert shapes.from_response_format({"type": "text"}) is None
    obj = shapes.from_response_format({"type": "json_object"})
    assert obj.kind == pb.STRUCTURED_KIND_JSON_OBJECT
    js = shapes.from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                             "strict": True}})
    assert (js.kind, json.loads(js.spec), js.strict) == (pb.STRUCTURED_KIND_JSON_SCHEMA, SCHEMA, True)
    loose = shapes.from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    assert loose.HasField("strict") and loose.strict is False  # OpenAI's default
    assert shapes.from_structured_outputs({"regex": "[a-z]+"}).kind == pb.STRUCTURED_KIND_REGEX
    assert json.loads(shapes.from_structured_outputs({"choice": ["yes", "no"]}).spec) == ["yes", "no"]
    assert shapes.from_structured_outputs({"json": json.dumps(SCHEMA)}).spec == json.dumps(SCHEMA)
    assert shapes.from_structured_outputs({"grammar": 'start: "a"'}).kind == pb.STRUCTURED_KIND_GRAMMAR
    assert shapes.from_structured_outputs({"json_object": True}).kind == pb.STRUCTURED_KIND_JSON_OBJECT
    guided = shapes.from_guided({"guided_json": SCHEMA, "top_k": 3})
    assert list(guided) == ["guided_json"] and json.loads(guided["guided_json"].spec) == SCHEMA


@pytest.mark.parametrize("call,field,words", [
    (lambda: shapes.from_response_format({"type": "structural_tag"}), "response_format.type", "not supported"),
    (lambda: shapes.from_response_format({"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema", "missing"),
    (lambda: shapes.from_response_format({"type": "json_schema", "json_schema": {"schema": "{"}}),
     "response_format.json_schema.schema", "not valid JSON"),
    (lambda: shapes.from_structured_outputs({"regex": "a", "choice": ["a"]}), "structured_outputs", "exactly one"),
    (lambda: shapes.from_structured_outputs({"choice": []}), "structured_outputs.choice", "non-empty"),
    (lambda: shapes.from_structured_outputs({"json": {}, "whitespace_pattern": " "}),
     "structured_outputs.whitespace_pattern", "not supported"),
    (lambda: shapes.from_guided({"guided_whitespace_pattern": " "}), "guided_whitespace_pattern", "not supported"),
    (lambda: shapes.one_source({"response_format": pb.StructuredOutput(), "guided_regex": pb.StructuredOutput()}),
     "response_format", "guided_regex and response_format"),
    (lambda: shapes.tools_from_openai([{"type": "function", "function": {"name": "bad name"}}]),
     "tools[0].function.name", "letters"),
    (lambda: shapes.tools_from_openai([{"type": "function", "function": {"name": "f"}}] * 2),
     "tools[1].function.name", "twice"),
    (lambda: shapes.tools_from_openai([{"type": "code_interpreter"}]), "tools[0].type", "function tools only"),
    (lambda: shapes.tool_choice_from_openai("any"), "tool_choice", "'required'"),
    (lambda: shapes.tool_calls_from_openai([{"function": {"name": "f", "arguments": "{x"}}], "messages[1].tool_calls"),
     "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
])
def test_shapes_refuse_by_name(call, field, words):
    with pytest.raises(shapes.ShapeError) as e:
        call()
    assert e.value.field == field and words in str(e.value)


def test_tools_and_choices_become_wire_messages():
    tools = shapes.tools_from_openai([{"type": "function", "function": {"name": "f", "description": "d",
                                                                         "parameters": SCHEMA, "strict": True}}])
    assert (tools[0].name, tools[0].description, json.loads(tools[0].parameters), tools[0].strict) == \
        ("f", "d", SCHEMA, True)
    assert shapes.tool_choice_from_openai("required").mode == pb.TOOL_CHOICE_MODE_REQUIRED
    assert shapes.tool_choice_from_openai({"type": "function", "function": {"name": "f"}}).function == "f"
    assert shapes.tool_choice_from_openai(None) is None
    calls = shapes.tool_calls_from_openai([{"id": "call_1", "type": "function",
                                            "function": {"name": "f", "arguments": {"a": 1}}}], "m")
    assert (calls[0].id, calls[0].name, json.loads(calls[0].arguments)) == ("call_1", "f", {"a": 1})
    assert shapes.tool_call_to_openai(calls[0])["function"]["name"] == "f"


# -- the HTTP and gRPC answers, on plain messages ------------------------------------------------
def _chunk(text: str, index: int = 0) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.Chunk(index=index, text=text))


def _complete(reason=pb.FINISH_REASON_STOP, index: int = 0) -> pb.GenerateResponse:
    return pb.GenerateResponse(complete=pb.Complete(index=index, finish_reason=reason,
                                                    usage=pb.Usage(prompt_tokens=3, completion_tokens=9)))


CALL_TEXT = ['Sure.\n<tool_', 'call>\n{"name": "get_weather", "arg', 'uments": {"city": "Pa', 'ris"}}\n</tool_call>']


def test_a_chat_stream_sends_openai_tool_call_deltas():
    from frontend.openai_responses import ChatStream, chat_completion_json

    stream = ChatStream("r", "m", False, False, str, HERMES)
    chunks = [c for t in CALL_TEXT for c in stream.feed(_chunk(t))] + stream.feed(_complete())
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": "Sure."}
    start = deltas[1]["tool_calls"][0]
    assert start["index"] == 0 and start["id"].startswith("call_") and start["type"] == "function"
    assert start["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[2:] if "tool_calls" in d)
    assert json.loads(args) == {"city": "Paris"}
    assert all(set(d["tool_calls"][0]) == {"index", "function"} for d in deltas[2:] if "tool_calls" in d)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # The whole answer: the same call, the text around it as content.
    whole = stream.collected
    body = chat_completion_json("r", "m", whole, False, str, HERMES)
    msg = body["choices"][0]["message"]
    assert msg["content"] == "Sure." and body["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("get_weather", {"city": "Paris"})]
    # Cut by max_tokens: "length" stays; no tools asked: the text is the content, untouched.
    cut = ChatStream("r", "m", False, False, str, HERMES)
    for t in CALL_TEXT[:2]:
        cut.feed(_chunk(t))
    assert cut.feed(_complete(pb.FINISH_REASON_LENGTH))[-1]["choices"][0]["finish_reason"] == "length"
    plain = chat_completion_json("r", "m", whole, False, str, None)["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "".join(CALL_TEXT)}
    assert plain["finish_reason"] == "stop"


def test_the_grpc_answer_carries_the_calls_in_its_complete():
    from tool_calling.requests import CallCollector

    calls = CallCollector(HERMES)
    for t in CALL_TEXT:
        assert calls.feed(_chunk(t)).chunk.text == t  # the raw text streams on
    done = calls.feed(_complete()).complete
    assert done.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert [(c.name, json.loads(c.arguments)) for c in done.tool_calls] == [("get_weather", {"city": "Paris"})]
    text_only = CallCollector(HERMES)
    text_only.feed(_chunk("Paris is sunny."))
    assert text_only.feed(_complete()).complete.finish_reason == pb.FINISH_REASON_STOP


def _chat(**fields) -> pb.ChatPrompt:
    return pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")], **fields)


WIRE_TOOLS = [pb.Tool(name="f", parameters='{"type": "object", "properties": {"a": {"type": "integer"}}}'),
              pb.Tool(name="g")]


@pytest.mark.parametrize("chat,field,words", [
    (_chat(tools=[pb.Tool(name="f", parameters="{")]), "chat.tools[0].parameters", "not valid JSON"),
    (_chat(tools=[pb.Tool(name="f", parameters="[1]")]), "chat.tools[0].parameters", "schema object"),
    (_chat(tools=[pb.Tool(name="f f")]), "chat.tools[0].name", "letters"),
    (_chat(tools=[pb.Tool(name="f"), pb.Tool(name="f")]), "chat.tools[1].name", "twice"),
    (_chat(tools=WIRE_TOOLS, tool_choice=pb.ToolChoice(function="h")), "tool_choice", "not among the tools"),
    (_chat(tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)), "tool_choice", "no tools"),
])
def test_the_router_refuses_raw_grpc_tools_by_name(chat, field, words):
    from tool_calling import requests as tool_requests

    with pytest.raises(tool_requests.ToolRequestError) as e:
        tool_requests.tool_constraint(chat, tool_requests.template_tools(chat), HERMES, "")
    assert e.value.field == field and words in str(e.value)


def test_tool_choice_picks_the_constraint():
    from tool_calling import requests as tool_requests

    def constraint(fmt=HERMES, **fields):
        chat = _chat(tools=WIRE_TOOLS, **fields)
        so = tool_requests.tool_constraint(chat, tool_requests.template_tools(chat), fmt, "")
        return None if so is None else json.loads(so.spec)

    auto = constraint()
    assert not auto["at_least_one"] and not auto["stop_after_first"] and len(auto["structures"]) == 2
    assert constraint(tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE)) is None
    assert constraint(fmt=LLAMA3_JSON) is None  # auto, and a format without tags
    req = constraint(tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), parallel_tool_calls=False)
    assert req["at_least_one"] and req["stop_after_first"]
    named = constraint(tool_choice=pb.ToolChoice(function="g"))
    assert [s["begin"] for s in named["structures"]] == ['<tool_call>\n{"name": "g", "arguments": ']
    with pytest.raises(tool_requests.ToolRequestError, match="format pdserve does not parse"):
        chat = _chat(tools=WIRE_TOOLS)
        tool_requests.tool_constraint(chat, tool_requests.template_tools(chat), None, "{{ tools }}")
    msgs = tool_requests.template_messages(pb.ChatPrompt(messages=[pb.ChatMessage(
        role="assistant", tool_calls=[pb.ToolCall(id="c", name="f", arguments='{"a": 1}')])]))
    assert msgs == [{"role": "assistant", "content": "",
                     "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]
    assert tool_requests.parses_calls(pb.GenerateRequest(chat=_chat(tools=WIRE_TOOLS)))
    assert not tool_requests.parses_calls(pb.GenerateRequest(chat=_chat(
        tools=WIRE_TOOLS, tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE))))


def test_an_openai_chat_body_with_tools_becomes_one_request():
    from frontend import openai_protocol as oai

    body = {"messages": [{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "call_1", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
            "tools": [{"type": "function", "function": TOOLS[0]}], "tool_choice": "required",
            "parallel_tool_calls": False}
    req = oai.ChatCompletionRequest.model_validate(body)
    assert req.parses_tool_calls
    g = req.to_generate("r")
    assert [t.name for t in g.chat.tools] == ["get_weather"]
    assert g.chat.tool_choice.mode == pb.TOOL_CHOICE_MODE_REQUIRED and g.chat.parallel_tool_calls is False
    assert g.chat.messages[1].tool_calls[0].name == "get_weather" and g.chat.messages[2].tool_call_id == "call_1"
    assert not g.sampling.HasField("structured")  # the router derives the tools' constraint
    rf = oai.ChatCompletionRequest.model_validate(
        {"messages": body["messages"][:1], "guided_choice": ["a", "b"]}).to_generate("r")
    assert rf.sampling.structured.kind == pb.STRUCTURED_KIND_CHOICE
    none = oai.ChatCompletionRequest.model_validate({**body, "tool_choice": "none"})
    assert not none.parses_tool_calls


# -- any calls, any split ----------------------------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_json_values = st.recursive(st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                       max_size=3), max_leaves=8)
_calls = st.lists(st.tuples(st.sampled_from(["f", "get_x", "a-b"]),
                            st.dictionaries(st.text(max_size=5), _json_values, max_size=3)), min_size=1, max_size=3)


def _render(fmt, calls) -> str:
    if fmt is SMOLLM2:
        return "<tool_call>[" + ", ".join(json.dumps({"name": n, "arguments": a}) for n, a in calls) + "]</tool_call>"
    if fmt is LLAMA3_JSON:
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return "\n".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)


@settings(max_examples=150, deadline=None)
@given(fmt=st.sampled_from([HERMES, SMOLLM2, LLAMA3_JSON]), calls=_calls,
       lead=st.text(alphabet="ab .\n", max_size=6), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_any_calls_in_any_split_parse_back(fmt, calls, lead, cuts):
    lead = "" if fmt is LLAMA3_JSON else lead  # a bare-JSON answer is a call only from its start
    text = lead + _render(fmt, calls)
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    content, got, _ = streamed(fmt, [text[a:b] for a, b in zip(points, points[1:])])
    assert got == [(n, a) for n, a in calls]
    assert content == lead.rstrip(" \t\r\n")  # whitespace next to a call is not content


_JSON_ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                    max_size=3), max_leaves=8)
_NEW_FIELDS = ["response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "guided_whitespace_pattern", "tools", "tool_choice", "parallel_tool_calls"]
_SHAPED = st.sampled_from([{"type": "json_schema", "json_schema": {"name": "x"}}, {"type": "json_object"},
                           {"json": {}}, {"choice": ["a"]}, [{"type": "function", "function": {"name": "f"}}],
                           {"type": "function", "function": {}}, "required"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_NEW_FIELDS), _JSON_ANY | _SHAPED, min_size=1, max_size=3),
       st.one_of(st.just("absent"), _JSON_ANY, st.just([{"id": "c", "function": {"name": "f", "arguments": "{"}}])))
def test_any_value_of_the_new_fields_is_taken_or_refused_by_name(fields, calls):
    """The HTTP API's reading of them: a request, or a 400 naming a field; never another error."""
    from pydantic import ValidationError

    from frontend import openai_protocol as oai

    msgs = [{"role": "user", "content": "x"}]
    if calls != "absent":
        msgs.append({"role": "assistant", "content": None, "tool_calls": calls})
    try:
        oai.ChatCompletionRequest.model_validate({"messages": msgs, **fields}).to_generate("r")
    except ValidationError:
        return
    except oai.UnsupportedError as e:
        assert e.param and e.param.split(".")[0].split("[")[0] in {*_NEW_FIELDS, "messages"}, (e.param, str(e))
