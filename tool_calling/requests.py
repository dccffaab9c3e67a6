"""A chat request's tools, as the router reads them off the wire (serving.proto ChatPrompt):
the template's input (messages with their tool calls and results, the tool list), the
constraint ``tool_choice`` asks for in the model's tool format, whether the answer is read
for calls, and the calls of a gRPC answer (``CallCollector``). Every refusal is a ValueError naming the field; router/validation.py makes it an
INVALID_ARGUMENT / HTTP 400. JSON nested deeper than tool_calling/json_limits.py's
``MAX_JSON_DEPTH`` (arguments, parameter schemas) is refused naming the limit before it is parsed.

The SDK and the HTTP API already checked the OpenAI shapes (protos/openai_shapes.py); a raw
gRPC client did not, so what the template and the constraint rely on is checked again here.
"""
from __future__ import annotations

import json
from typing import Any

from protos.openai_shapes import FUNCTION_NAME
from protos.pdserve.v1 import serving_pb2 as pb
from tokens.sampling_params import StructuredOutput
from tool_calling.formats import ToolFormat, call_constraint, unsupported_message
from tool_calling.json_limits import JsonDepthError, check_depth
from tool_calling.parser import ToolCallParser


class ToolRequestError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def parses_calls(req: pb.GenerateRequest) -> bool:
    """The answer is read for tool calls: a chat with tools whose tool_choice is not NONE."""
    if req.WhichOneof("prompt") != "chat" or not req.chat.tools:
        return False
    choice = req.chat.tool_choice
    return not (choice.WhichOneof("choice") == "mode" and choice.mode == pb.TOOL_CHOICE_MODE_NONE)


def _json(field: str, text: str) -> Any:
    try:
        check_depth(field, text)  # before json.loads, which would raise RecursionError
        return json.loads(text)
    except JsonDepthError as e:
        raise ToolRequestError(field, str(e)) from None
    except ValueError as e:
        raise ToolRequestError(field, f"{field} is not valid JSON: {e}") from None


def template_messages(chat: pb.ChatPrompt) -> list[dict]:
    """The messages as transformers hands them to a template: tool-call arguments as objects
    (the templates write them with ``tojson``), the tool fields only where set."""
    out = []
    for i, m in enumerate(chat.messages):
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name,
                              "arguments": _json(f"chat.messages[{i}].tool_calls[{j}].arguments", c.arguments or "{}")}}
                for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out


def template_tools(chat: pb.ChatPrompt) -> list[dict]:
    """The tools as plain dicts ({"name", "description", "parameters", "strict"})."""
    out, seen = [], set()
    for i, t in enumerate(chat.tools):
        field = f"chat.tools[{i}]"
        if not FUNCTION_NAME.fullmatch(t.name):
            raise ToolRequestError(f"{field}.name", f"{field}.name must be 1 to 64 letters, digits, '_' or '-', "
                                                    f"got {t.name[:80]!r}")
        if t.name in seen:
            raise ToolRequestError(f"{field}.name", f"{field}.name {t.name!r} is given twice")
        seen.add(t.name)
        params = _json(f"{field}.parameters", t.parameters) if t.parameters else None
        if params is not None and not isinstance(params, dict):
            raise ToolRequestError(f"{field}.parameters", f"{field}.parameters must be a JSON schema object")
        out.append({"name": t.name, "description": t.description, "parameters": params,
                    "strict": t.strict if t.HasField("strict") else None})
    return out


def text_length(chat: pb.ChatPrompt) -> int:
    """Characters the template is given (the prompt-size check before tokenizing)."""
    n = sum(len(m.content) + len(m.role) + sum(len(c.name) + len(c.arguments) for c in m.tool_calls)
            for m in chat.messages)
    return n + sum(len(t.name) + len(t.description) + len(t.parameters) for t in chat.tools)


def tool_constraint(chat: pb.ChatPrompt, tools: list[dict], fmt: ToolFormat | None,
                    template: str | None) -> StructuredOutput | None:
    """What ``tool_choice`` asks of the output in ``fmt``: None for "none" (and for "auto" in a
    format without tags); refuses a choice that cannot be met."""
    which = chat.tool_choice.WhichOneof("choice")
    mode = chat.tool_choice.mode if which == "mode" else pb.TOOL_CHOICE_MODE_UNSPECIFIED
    function = chat.tool_choice.function if which == "function" else None
    if not tools:
        if function is not None or mode == pb.TOOL_CHOICE_MODE_REQUIRED:
            raise ToolRequestError("tool_choice", "tool_choice asks for a tool call but the request has no tools")
        return None
    if fmt is None:
        raise ToolRequestError("tools", unsupported_message(template))
    if function is not None and function not in {t["name"] for t in tools}:
        raise ToolRequestError("tool_choice", f"tool_choice names function {function[:80]!r}, which is not "
                                              f"among the tools ({', '.join(t['name'] for t in tools)})")
    if mode == pb.TOOL_CHOICE_MODE_NONE:
        return None
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    return call_constraint(fmt, tools, required=mode == pb.TOOL_CHOICE_MODE_REQUIRED, parallel=parallel,
                           function=function)


class CallCollector:
    """The gRPC answer's tool calls: each sample's text through a parser, its calls written into
    its Complete (``tool_calls``, finish reason TOOL_CALLS when it stopped by itself). Chunks
    pass unchanged: a gRPC client streams the model's raw text."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._parsers: dict[int, ToolCallParser] = {}

    def feed(self, resp: pb.GenerateResponse) -> pb.GenerateResponse:
        kind = resp.WhichOneof("kind")
        if kind == "chunk":
            self._parser(resp.chunk.index).feed(resp.chunk.text)
            return resp
        if kind != "complete":
            return resp
        parser = self._parser(resp.complete.index)
        parser.finish()
        if not parser.calls:
            return resp
        out = pb.GenerateResponse()
        out.CopyFrom(resp)
        out.complete.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments_text)
                                       for c in parser.calls)
        if out.complete.finish_reason == pb.FINISH_REASON_STOP:
            out.complete.finish_reason = pb.FINISH_REASON_TOOL_CALLS
        return out

    def _parser(self, index: int) -> ToolCallParser:
        p = self._parsers.get(index)
        if p is None:
            p = self._parsers[index] = ToolCallParser(self.fmt)
        return p
