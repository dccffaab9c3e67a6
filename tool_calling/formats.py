"""The tool-call formats of the chat templates pdserve serves: which one a model uses (read from
its chat template), how tools and the tool turns of a conversation reach the template, and the
structured-output constraint that makes a call in that format always parse. Torch-free plain
data; the parser of the output is tool_calling/parser.py.

The formats, as the models were trained to write a call:

- ``hermes`` (Qwen2.5, Qwen3, Hermes and every template that writes ``<tool_call>``): one tag
  per call, ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, several calls in
  a row for parallel calls, text allowed around them. The template renders the tools itself.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3: templates with ``<|python_tag|>`` / ``ipython``): the
  whole answer is a bare JSON object ``{"name": "f", "parameters": {...}}`` (after the special
  ``<|python_tag|>``, which detokenizing drops), one call per answer (the template refuses
  several in the history). The template renders the tools itself.
- ``smollm2``: for templates that do not render tools at all, SmolLM2-Instruct's among them (the
  builtin model's template is plain ChatML). pdserve writes the tools into the system message
  in the format SmolLM2-Instruct's model card documents: ``<tools>[...]</tools>``, calls as
  ``<tool_call>[{"name": "f", "arguments": {...}}]</tool_call>``; tool results go back as user
  turns in ``<tool_response>`` tags, the tool calls of the history as the assistant's text.

A template that mentions tools in another format (Mistral's ``[TOOL_CALLS]``, ...) is refused
by name rather than parsed wrongly.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokens.sampling_params import StructuredOutput


class ToolFormatError(ValueError):
    """Tools were asked of a model whose chat template has no tool format pdserve knows."""


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How one family writes a call. ``open`` / ``close`` delimit a tag (empty: bare JSON);
    ``lists``: a tag may hold a JSON list of calls; ``args_key``: the key of the arguments in
    the call object; ``renders_tools``: the template renders tools itself (else pdserve does).
    ``call_open`` / ``call_close`` are what the constraint writes around each call's arguments
    (with the function's name in ``call_open``)."""

    name: str
    open: str
    close: str
    args_key: str
    lists: bool
    renders_tools: bool
    call_open: str  # with {name}: the function's name as a JSON string
    call_close: str
    trigger: str  # the text a constrained call starts with (a prefix of every call_open)
    parallel: bool  # the format can carry several calls in one answer
    constrain_auto: bool  # "auto" is constrained to "text, or calls that parse"

    def begin(self, name: str) -> str:
        return self.call_open.replace("{name}", json.dumps(name))


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", lists=True, renders_tools=True,
                    call_open='<tool_call>\n{"name": {name}, "arguments": ', call_close="}\n</tool_call>",
                    trigger="<tool_call>", parallel=True, constrain_auto=True)
SMOLLM2 = ToolFormat("smollm2", "<tool_call>", "</tool_call>", "arguments", lists=True, renders_tools=False,
                     call_open='<tool_call>[{"name": {name}, "arguments": ', call_close="}]</tool_call>",
                     trigger="<tool_call>", parallel=True, constrain_auto=True)
# A bare JSON answer has no tag to trigger on: "auto" stays unconstrained (a text answer that
# starts with "{" would otherwise be forced into a call).
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "parameters", lists=False, renders_tools=True,
                         call_open='{"name": {name}, "parameters": ', call_close="}",
                         trigger='{"name": ', parallel=False, constrain_auto=False)
FORMATS = {f.name: f for f in (HERMES, SMOLLM2, LLAMA3_JSON)}


def detect_format(template: str | None) -> ToolFormat | None:
    """The tool format of a chat template's source; None when tools cannot be served (no
    template, or one that renders tools in a format pdserve does not parse)."""
    if not template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3_JSON
    if "tools" not in template and "tool_calls" not in template:
        return SMOLLM2
    return None


def unsupported_message(template: str | None) -> str:
    if not template:
        return "this model's tokenizer has no chat template, so it cannot be given tools"
    return ("this model's chat template renders tools in a format pdserve does not parse (pdserve parses "
            "<tool_call> tags (Qwen, Hermes), Llama 3's JSON calls, and renders SmolLM2's format for "
            "templates without tools); send the request without tools")


# -- what the template is given ------------------------------------------------------------------
def openai_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Plain tool dicts ({"name", "description", "parameters"}) in OpenAI's shape, the shape
    transformers hands a template (``tools=[...]`` of apply_chat_template)."""
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t["name"]}
        if t.get("description"):
            fn["description"] = t["description"]
        fn["parameters"] = t.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def template_inputs(fmt: ToolFormat | None, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]]) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to render. ``messages`` are dicts with role, content and, where set,
    ``tool_calls`` ([{"id", "type", "function": {"name", "arguments": dict}}]), ``tool_call_id``,
    ``name``. A template that renders tools gets them as they are; for one that does not,
    pdserve writes the tools and the tool turns into the messages (``smollm2``)."""
    if fmt is None or fmt.renders_tools:
        return [dict(m) for m in messages], (openai_tools(tools) if tools else None)
    return _smollm2_messages(messages, tools), None


_SMOLLM2_SYSTEM = (
    "You can call functions to answer the user. These are the functions you may call, as JSON:\n"
    "<tools>{tools}</tools>\n"
    "To call functions, answer with only a JSON list of the calls inside <tool_call></tool_call> tags, "
    "each call an object with the function's name and its arguments:\n"
    '<tool_call>[{{"name": "function_name", "arguments": {{"argument": "value"}}}}]</tool_call>\n'
    "Give every required argument with the type its schema asks for. If no function fits the "
    "question, answer in plain text instead.")


def smollm2_call_text(calls: Sequence[Mapping[str, Any]]) -> str:
    """A turn's calls as SmolLM2 writes them: one tag per call, as the constraint generates."""
    return "\n".join("<tool_call>[" + json.dumps({"name": c["function"]["name"],
                                                  "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                     + "]</tool_call>" for c in calls)


def _smollm2_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict]:
    out: list[dict] = []
    if tools:
        listed = json.dumps([openai_tools([t])[0]["function"] for t in tools], ensure_ascii=False)
        system = _SMOLLM2_SYSTEM.format(tools=listed)
        if messages and messages[0]["role"] == "system":
            system = f"{messages[0]['content']}\n\n{system}"
            messages = messages[1:]
        out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            text = m.get("content") or ""
            calls = smollm2_call_text(m["tool_calls"])
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        m.pop("_tool_results", None)
    return out


# -- the constraint ------------------------------------------------------------------------------
def call_constraint(fmt: ToolFormat, tools: Sequence[Mapping[str, Any]], *, required: bool,
                    parallel: bool, function: str | None = None) -> StructuredOutput | None:
    """The structural tag that keeps calls in ``fmt`` valid: one structure per function (only
    ``function`` when named) whose JSON is the function's parameter schema. ``required`` (or a
    named function): the answer is calls only, at least one; else text, and any call begun is
    completed valid (None where the format cannot tell a call from text: ``constrain_auto``).
    Strict only when every function says ``strict: true`` (OpenAI's default is false)."""
    if not required and function is None and not fmt.constrain_auto:
        return None
    chosen = [t for t in tools if function is None or t["name"] == function]
    structures = [{"begin": fmt.begin(t["name"]), "schema": _parameters_schema(t.get("parameters")),
                   "end": fmt.call_close} for t in chosen]
    spec = {"structures": structures, "triggers": [fmt.trigger], "at_least_one": required or function is not None,
            "stop_after_first": function is not None or not (parallel and fmt.parallel)}
    strict = bool(chosen) and all(t.get("strict") is True for t in chosen)
    return StructuredOutput("structural_tag", json.dumps(spec, ensure_ascii=False), strict=strict)


def _parameters_schema(params: Mapping[str, Any] | None) -> dict:
    # No parameters: an empty object, closed, so that nothing but "{}" can be generated.
    return dict(params) if params else {"type": "object", "properties": {}, "additionalProperties": False}
