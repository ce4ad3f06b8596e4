"""JSON schemas of real shapes (nested objects, enums, arrays, bounded numbers), small enough that a random
model finishes them within a few dozen byte-level tokens, and a checker we did not write (``jsonschema``)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "name": {"type": "string", "maxLength": 4},
            "ok": {"type": "boolean"},
        },
        "required": ["age", "name", "ok"],
        "additionalProperties": False,
    },
    "enum_and_array": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "boolean"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "kind": {"const": "pt"},
        },
        "required": ["point", "kind"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "array",
        "items": {"enum": ["a", "b", 1, None]},
        "minItems": 1,
        "maxItems": 4,
    },
}


def assert_valid(text: str, schema: dict[str, Any], backend: str = "guidance") -> None:
    """``text`` is one JSON value valid against ``schema`` (raises otherwise: ``json.JSONDecodeError`` or
    ``jsonschema.ValidationError``). xgrammar (0.2.9) lets raw control characters into a string with a
    ``maxLength``, which strict JSON forbids; its outputs are parsed as ``json.loads(strict=False)`` does."""
    jsonschema.validate(json.loads(text, strict=backend != "xgrammar"), schema)
