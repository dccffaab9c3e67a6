"""OpenAI's and vLLM's request shapes for structured outputs and tools, to serving.proto
messages: shared by the router's HTTP API (frontend/openai_protocol.py) and the SDK (pdserve/),
so that ``response_format=``, ``structured_outputs`` / ``guided_*`` and ``tools=`` mean the same
through either. Plain dicts in, protobuf messages out, no I/O and nothing but the wire imported
(the SDK ships it).

Each refusal is a ``ShapeError`` (a ValueError) whose ``field`` names the request field at
fault, in the caller's spelling (``response_format.json_schema.schema``): the HTTP API answers
400 with it as ``param``, the SDK raises InvalidRequestError with it as ``field``. What only the
server can decide (a schema keyword the grammar engine cannot enforce, a tool format the served
model's chat template lacks, tool_choice naming an unknown function) is checked by the router.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from protos.pdserve.v1 import serving_pb2 as pb

# OpenAI's rule for function names; it also keeps a name safe to write inside the JSON text of
# a tool-call tag without escaping.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128  # OpenAI's limit on tools per request
# vLLM's structured_outputs keys that select a constraint (exactly one), and the options pdserve
# refuses by name because the grammar they ask for differs from what pdserve would enforce.
VLLM_KINDS = {"json": pb.STRUCTURED_KIND_JSON_SCHEMA, "regex": pb.STRUCTURED_KIND_REGEX,
              "choice": pb.STRUCTURED_KIND_CHOICE, "grammar": pb.STRUCTURED_KIND_GRAMMAR,
              "json_object": pb.STRUCTURED_KIND_JSON_OBJECT}
VLLM_REFUSED = ("structural_tag", "whitespace_pattern", "disable_any_whitespace", "disable_additional_properties")
# vLLM's older top-level extras (removed in vLLM 0.12, still sent by many clients).
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
GUIDED_REFUSED = ("guided_whitespace_pattern",)


class ShapeError(ValueError):
    """A request field that cannot become a wire message; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _json_text(field: str, value: Any) -> str:
    """A schema given as a dict (or JSON text) -> JSON text."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as e:
            raise ShapeError(field, f"{field} is not valid JSON: {e}") from None
        return value
    if not isinstance(value, Mapping) and value is not True:
        raise ShapeError(field, f"{field} must be a JSON schema object, got {type(value).__name__}")
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ShapeError(field, f"{field} is not JSON: {e}") from None


def _strict(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ShapeError(field, f"{field} must be true or false, got {value!r}")
    return value


# -- structured outputs -----------------------------------------------------------------------
def from_response_format(rf: Any, field: str = "response_format") -> pb.StructuredOutput | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (None: no constraint),
    ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}``. ``strict`` absent means false, as in OpenAI: keywords the engine cannot enforce
    are then ignored instead of refused."""
    if not isinstance(rf, Mapping):
        raise ShapeError(field, f"{field} must be an object with a 'type', got {type(rf).__name__}")
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return pb.StructuredOutput(kind=pb.STRUCTURED_KIND_JSON_OBJECT)
    if kind != "json_schema":
        raise ShapeError(f"{field}.type", f"{field}.type {kind!r} is not supported; pdserve takes "
                                          "'text', 'json_object' and 'json_schema'")
    js = rf.get("json_schema")
    if not isinstance(js, Mapping):
        raise ShapeError(f"{field}.json_schema", f"{field}.json_schema must be an object with 'name' and 'schema'")
    if "schema" not in js:
        raise ShapeError(f"{field}.json_schema.schema", f"{field}.json_schema.schema is missing")
    spec = _json_text(f"{field}.json_schema.schema", js["schema"])
    strict = _strict(f"{field}.json_schema.strict", js.get("strict") or False)
    return pb.StructuredOutput(kind=pb.STRUCTURED_KIND_JSON_SCHEMA, spec=spec, strict=strict)


def from_structured_outputs(so: Any, field: str = "structured_outputs") -> pb.StructuredOutput:
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``regex``, ``choice``
    (a list of strings), ``grammar`` (Lark, or GBNF), ``json_object: true``. Strict: a construct
    the engine cannot enforce is refused (vLLM refuses what its backend cannot compile)."""
    if not isinstance(so, Mapping):
        raise ShapeError(field, f"{field} must be an object, got {type(so).__name__}")
    for key in VLLM_REFUSED:
        if so.get(key) not in (None, False):
            raise ShapeError(f"{field}.{key}", f"{field}.{key} is not supported by pdserve")
    given = [k for k in VLLM_KINDS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise ShapeError(field, f"{field} must set exactly one of {', '.join(VLLM_KINDS)}; got "
                                f"{', '.join(given) or 'none'}")
    key = given[0]
    value, where = so[key], f"{field}.{key}"
    kind = VLLM_KINDS[key]
    if key == "json":
        return pb.StructuredOutput(kind=kind, spec=_json_text(where, value), strict=True)
    if key == "json_object":
        if value is not True:
            raise ShapeError(where, f"{where} must be true, got {value!r}")
        return pb.StructuredOutput(kind=kind, strict=True)
    if key == "choice":
        if (isinstance(value, str) or not isinstance(value, Sequence) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise ShapeError(where, f"{where} must be a non-empty list of non-empty strings")
        return pb.StructuredOutput(kind=kind, spec=json.dumps(list(value), ensure_ascii=False), strict=True)
    if not isinstance(value, str) or not value.strip():
        raise ShapeError(where, f"{where} must be a non-empty string")
    return pb.StructuredOutput(kind=kind, spec=value, strict=True)


def from_guided(extras: Mapping[str, Any]) -> dict[str, pb.StructuredOutput]:
    """vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
    extras: each one given -> its message, by the field's name."""
    for key in GUIDED_REFUSED:
        if extras.get(key) is not None:
            raise ShapeError(key, f"{key} is not supported by pdserve")
    return {name: from_structured_outputs({key: extras[name]}, name)
            for name, key in GUIDED.items() if extras.get(name) is not None}


def one_source(sources: Mapping[str, pb.StructuredOutput | None]) -> pb.StructuredOutput | None:
    """The one constraint among those given by name (None: none given); two or more are refused
    naming them, since the output can follow only one."""
    given = {k: v for k, v in sources.items() if v is not None}
    if len(given) > 1:
        names = sorted(given)
        raise ShapeError(names[1], f"give one structured-output constraint, not several: {' and '.join(names)} "
                                   "were both set")
    return next(iter(given.values()), None)


# -- tools -----------------------------------------------------------------------------------
def tools_from_openai(tools: Any, field: str = "tools") -> list[pb.Tool]:
    """OpenAI's ``tools``: ``[{"type": "function", "function": {"name", "description",
    "parameters", "strict"}}]``; names unique and OpenAI-shaped."""
    if isinstance(tools, str | Mapping) or not isinstance(tools, Sequence):
        raise ShapeError(field, f"{field} must be a list of {{'type': 'function', 'function': ...}} objects")
    if len(tools) > MAX_TOOLS:
        raise ShapeError(field, f"{field} may hold at most {MAX_TOOLS} functions, got {len(tools)}")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(t, Mapping) or t.get("type", "function") != "function":
            raise ShapeError(f"{where}.type", f"{where} must be {{'type': 'function', 'function': ...}} "
                                              "(function tools only)")
        fn = t.get("function")
        if not isinstance(fn, Mapping):
            raise ShapeError(f"{where}.function", f"{where}.function must be an object with a 'name'")
        name = _function_name(f"{where}.function.name", fn.get("name"))
        if name in seen:
            raise ShapeError(f"{where}.function.name", f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise ShapeError(f"{where}.function.description", f"{where}.function.description must be a string")
        tool = pb.Tool(name=name, description=desc)
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, Mapping):
                raise ShapeError(f"{where}.function.parameters",
                                 f"{where}.function.parameters must be a JSON schema object")
            tool.parameters = _json_text(f"{where}.function.parameters", params)
        if fn.get("strict") is not None:
            tool.strict = _strict(f"{where}.function.strict", fn["strict"])
        out.append(tool)
    return out


def _function_name(field: str, name: Any) -> str:
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ShapeError(field, f"{field} must be 1 to 64 letters, digits, '_' or '-', got {name!r:.80}")
    return name


def tool_choice_from_openai(choice: Any, field: str = "tool_choice") -> pb.ToolChoice | None:
    """``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function": {"name"}}``
    (None: not given)."""
    if choice is None:
        return None
    if isinstance(choice, str):
        modes = {"auto": pb.TOOL_CHOICE_MODE_AUTO, "none": pb.TOOL_CHOICE_MODE_NONE,
                 "required": pb.TOOL_CHOICE_MODE_REQUIRED}
        if choice not in modes:
            raise ShapeError(field, f"{field} must be 'none', 'auto', 'required' or "
                                    f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r:.40}")
        return pb.ToolChoice(mode=modes[choice])
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("function"), Mapping):
        return pb.ToolChoice(function=_function_name(f"{field}.function.name", choice["function"].get("name")))
    raise ShapeError(field, f"{field} must be 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}")


def tool_calls_from_openai(calls: Any, field: str) -> list[pb.ToolCall]:
    """An assistant message's ``tool_calls`` of the history: ``[{"id", "type": "function",
    "function": {"name", "arguments"}}]``, arguments as JSON text (OpenAI) or an object."""
    if isinstance(calls, str | Mapping) or not isinstance(calls, Sequence):
        raise ShapeError(field, f"{field} must be a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        where = f"{field}[{j}]"
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping):
            raise ShapeError(where, f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = _json_text(f"{where}.function.arguments", args)
        else:
            try:
                json.loads(args)
            except ValueError as e:
                raise ShapeError(f"{where}.function.arguments",
                                 f"{where}.function.arguments is not valid JSON: {e}") from None
        call_id = c.get("id") or ""
        if not isinstance(call_id, str):
            raise ShapeError(f"{where}.id", f"{where}.id must be a string")
        out.append(pb.ToolCall(id=call_id, name=_function_name(f"{where}.function.name", fn.get("name")),
                               arguments=args))
    return out


def tool_call_to_openai(call: pb.ToolCall) -> dict:
    """A parsed call as OpenAI's message ``tool_calls`` entry."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
