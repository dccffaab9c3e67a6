"""The request sets `pdserve bench structured` decodes (plain data): each request is a prompt
text and the JSON schema its output is constrained to.

- ``warm``: one request per schema of structured_cases.py GENERATION_SCHEMAS (``--quick``:
  bounded ones a random model closes); each schema compiles once and is cached after that.
- ``cold``: the same requests, each under a schema no request used before (a fresh
  ``$comment``, which changes the spec and so the cache key, not the grammar): every request
  pays the compile, and its first masks build a lexer no earlier request warmed.
- ``github``: real schemas, a sample of JSONSchemaBench's GitHub medium and hard subsets
  (bench/structured_data/jsonschemabench.json, copied unchanged, the source named there).
- ``tools``: one request per task, all under one schema: JSONSchemaBench's GlaiveAI
  function-call parameter schemas, each as ``{"name": const, "arguments": parameters}`` under
  ``anyOf``, as a tool call with several tools is constrained. The tasks are hand-written.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.structured_cases import GENERATION_SCHEMAS, case

DATA = Path(__file__).with_name("structured_data") / "jsonschemabench.json"

# Bounded variants for --quick: a random-weight model never closes a free string by itself.
QUICK_SCHEMAS = (
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["color", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                      "ok": {"type": "boolean"}},
     "required": ["code", "ok"], "additionalProperties": False},
)

# Hand-written tasks for the tools set (not from the benchmark): one per request.
TOOL_TASKS = (
    "Add a dentist appointment on 2025-05-14 from 09:30 to 10:15.",
    "Find me a hotel in Lisbon from 2025-03-02 to 2025-03-05 under 120 a night.",
    "Invoice ACME Corp for 3 hours of consulting at 90 and one licence at 400, invoice INV-0042.",
    "Set up a meeting with Ana and Bo in room 4B tomorrow 14:00 to 15:00 UTC.",
    "Look for noise-cancelling headphones between 100 and 250.",
    "Email sam@example.com that the report is late, subject: Report.",
    "Find a cheap Thai restaurant in Berlin Mitte.",
    "Put the team offsite on 2025-06-20, 10:00 to 16:00, at the lake house.",
)


@dataclass(frozen=True)
class RequestSet:
    name: str
    asks: tuple[str, ...]  # the prompt text of each request (the chat template wraps it)
    schemas: tuple[dict[str, Any], ...]  # each request's schema (what its output validates against)
    fresh: bool = False  # True: every request, every round, compiles a schema of its own

    def __len__(self) -> int:
        return len(self.asks)

    def head(self, n: int | None) -> RequestSet:
        """The first ``n`` requests (all when None)."""
        return RequestSet(self.name, self.asks[:n], self.schemas[:n], self.fresh)


def ask(schema: dict) -> str:
    return ("Reply with only a JSON value, no prose, that matches this JSON schema, with realistic values:\n"
            + json.dumps(schema))


def fresh_schema(schema: dict, nonce: str) -> dict:
    """``schema`` under a spec no other request has: same grammar, new cache key."""
    return {"$comment": f"request {nonce}", **schema}


def load_data() -> dict:
    return json.loads(DATA.read_text())


def tools_schema(tools: list[dict]) -> dict:
    """A tool call with several tools: one ``{"name", "arguments"}`` object per tool under anyOf."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}


def request_sets(quick: bool) -> list[RequestSet]:
    schemas = tuple(QUICK_SCHEMAS) if quick else tuple(case(n).schema for n in GENERATION_SCHEMAS)
    asks = tuple(ask(s) for s in schemas)
    data = load_data()
    github = tuple(e["schema"] for e in data["github"])
    tools = tools_schema(data["glaive_tools"])
    listing = "\n".join(f"- {t['name']}: {json.dumps(t['parameters'])}" for t in data["glaive_tools"])
    tool_asks = tuple(f"You can call these tools:\n{listing}\nReply with only the call, as JSON "
                      f'{{"name": ..., "arguments": {{...}}}}, that does this: {task}' for task in TOOL_TASKS)
    return [RequestSet("warm", asks, schemas),
            RequestSet("cold", asks, schemas, fresh=True),
            RequestSet("github", tuple(ask(s) for s in github), github),
            RequestSet("tools", tool_asks, (tools,) * len(tool_asks))]
