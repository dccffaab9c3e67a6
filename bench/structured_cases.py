"""The JSON schemas `pdserve bench structured` measures grammar engines on, each with an
instance that satisfies it and one that breaks the construct it tests (plain data, also used
by tests/test_structured_engine.py).

A construct counts as *covered* by an engine when the schema compiles, the engine accepts the
valid instance token by token and refuses the invalid one. An engine that compiles a schema
but lets the invalid instance through ignores the construct (it would emit output that fails
``jsonschema``), which is worse than refusing the schema.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    valid: Any
    invalid: Any


_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "address"],
}

CASES: tuple[SchemaCase, ...] = (
    SchemaCase("nested objects", _PERSON,
               {"name": "Ada", "age": 36, "address": {"city": "London", "zip": "W1"}},
               {"name": "Ada", "age": 36, "address": {"zip": "W1"}}),
    SchemaCase("array minItems/maxItems",
               {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                          "minItems": 2, "maxItems": 3}},
                "required": ["tags"]},
               {"tags": ["a", "b"]}, {"tags": ["a"]}),
    SchemaCase("enum",
               {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                "required": ["color"]},
               {"color": "green"}, {"color": "purple"}),
    SchemaCase("integer range",
               {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 20}},
                "required": ["n"]},
               {"n": 15}, {"n": 25}),
    SchemaCase("number exclusive range",
               {"type": "object", "properties": {"x": {"type": "number", "exclusiveMinimum": 0,
                                                       "exclusiveMaximum": 1}},
                "required": ["x"]},
               {"x": 0.5}, {"x": 1.5}),
    SchemaCase("nullable and optional",
               {"type": "object", "properties": {"a": {"type": ["string", "null"]}, "b": {"type": "integer"}},
                "required": ["a"], "additionalProperties": False},
               {"a": None}, {"b": 1}),
    SchemaCase("string pattern",
               {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"]},
               {"code": "ABC-12"}, {"code": "abc-12"}),
    SchemaCase("minLength/maxLength",
               {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
                "required": ["s"]},
               {"s": "abc"}, {"s": "abcdef"}),
    SchemaCase("$ref/$defs",
               {"type": "object", "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                   "required": ["x"], "additionalProperties": False}},
                "properties": {"p": {"$ref": "#/$defs/pt"}}, "required": ["p"]},
               {"p": {"x": 1}}, {"p": {"y": 1}}),
    SchemaCase("recursive $ref",
               {"$defs": {"node": {"type": "object",
                                   "properties": {"v": {"type": "integer"},
                                                  "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                                   "required": ["v"], "additionalProperties": False}},
                "$ref": "#/$defs/node"},
               {"v": 1, "kids": [{"v": 2, "kids": []}]}, {"v": 1, "kids": [{"w": 2}]}),
    SchemaCase("anyOf",
               {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
                "required": ["id"]},
               {"id": "x7"}, {"id": True}),
    SchemaCase("oneOf",
               {"type": "object", "properties": {"shape": {"oneOf": [
                   {"type": "object", "properties": {"r": {"type": "number"}}, "required": ["r"],
                    "additionalProperties": False},
                   {"type": "object", "properties": {"w": {"type": "number"}}, "required": ["w"],
                    "additionalProperties": False}]}},
                "required": ["shape"]},
               {"shape": {"r": 2}}, {"shape": {"q": 2}}),
    SchemaCase("allOf",
               {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                          {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
               {"a": 1, "b": 2}, {"a": 1}),
    SchemaCase("additionalProperties false",
               {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                "additionalProperties": False},
               {"a": 1}, {"a": 1, "z": 2}),
    SchemaCase("additionalProperties schema",
               {"type": "object", "additionalProperties": {"type": "integer"}},
               {"k": 1, "j": 2}, {"k": "one"}),
    SchemaCase("const",
               {"type": "object", "properties": {"v": {"const": "fixed"}}, "required": ["v"]},
               {"v": "fixed"}, {"v": "other"}),
    SchemaCase("format date-time",
               {"type": "object", "properties": {"t": {"type": "string", "format": "date-time"}}, "required": ["t"]},
               {"t": "2024-05-01T12:30:00Z"}, {"t": "yesterday"}),
    SchemaCase("format email",
               {"type": "object", "properties": {"e": {"type": "string", "format": "email"}}, "required": ["e"]},
               {"e": "ada@example.com"}, {"e": "not an email"}),
    SchemaCase("format uuid",
               {"type": "object", "properties": {"u": {"type": "string", "format": "uuid"}}, "required": ["u"]},
               {"u": "123e4567-e89b-12d3-a456-426614174000"}, {"u": "1234"}),
    SchemaCase("prefixItems (tuple)",
               {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
               ["a", 1], [1, "a"]),
    SchemaCase("minProperties",
               {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
               {"k": 1}, {}),
    SchemaCase("uniqueItems",
               {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
               [1, 2], [1, 1]),
    SchemaCase("multipleOf",
               {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}, "required": ["n"]},
               {"n": 15}, {"n": 7}),
    SchemaCase("not",
               {"type": "object", "properties": {"n": {"not": {"type": "string"}}}, "required": ["n"]},
               {"n": 1}, {"n": "s"}),
)

# What the live and engine tests generate against: constructs every output must satisfy
# (jsonschema-validated), one per family the issue names.
GENERATION_SCHEMAS: tuple[str, ...] = (
    "nested objects", "array minItems/maxItems", "enum", "integer range", "nullable and optional",
    "string pattern", "$ref/$defs", "anyOf", "additionalProperties false",
)


def case(name: str) -> SchemaCase:
    return next(c for c in CASES if c.name == name)
