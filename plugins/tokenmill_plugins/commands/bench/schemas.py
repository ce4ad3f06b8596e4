"""The JSON schemas and tools ``tokenmill bench structured`` constrains requests with.

Shapes that extraction pipelines and agents send (records, orders, events, nested objects, enums, arrays,
bounded numbers, alternatives, optional fields), each bounded (``maxLength``, ``maxItems``) so that a reply
sampled at temperature 1.0 ends within the run's ``max_tokens``: an unbounded string would measure the token
budget, not the grammar.
"""

from __future__ import annotations

from typing import Any


def _obj(properties: dict[str, Any], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """An object schema: every property required unless named in ``optional``; no other properties."""
    return {
        "type": "object",
        "properties": properties,
        "required": [name for name in properties if name not in optional],
        "additionalProperties": False,
    }


def _str(max_length: int = 12, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **extra}


def _int(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def _array(items: dict[str, Any], max_items: int, min_items: int = 0) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


#: Schema name -> schema. Names are the ``json_schema.name`` sent with each request.
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _obj({"name": _str(16), "age": _int(0, 120), "email": _str(24)}),
    "address": _obj(
        {
            "street": _str(20),
            "city": _str(16),
            "zip": _str(5, pattern="^[0-9]{5}$"),
            "country": {"enum": ["US", "DE", "FR", "JP", "BR"]},
        }
    ),
    "sentiment": _obj({"label": {"enum": ["positive", "negative", "neutral"]}, "score": {"type": "number"}}),
    "classification": _obj(
        {"category": {"enum": ["billing", "bug", "feature", "other"]}, "urgent": {"type": "boolean"}}
    ),
    "order": _obj(
        {
            "order_id": _str(10),
            "items": _array(_obj({"sku": _str(8), "quantity": _int(1, 99)}), 4, 1),
            "total": {"type": "number", "minimum": 0},
        }
    ),
    "event": _obj({"title": _str(20), "day": _int(1, 31), "month": _int(1, 12), "all_day": {"type": "boolean"}}),
    "product": _obj(
        {
            "name": _str(16),
            "price": {"type": "number", "minimum": 0, "maximum": 10000},
            "tags": _array(_str(8), 3),
            "in_stock": {"type": "boolean"},
        }
    ),
    "nested_company": _obj(
        {
            "company": _str(16),
            "ceo": _obj({"name": _str(16), "since": _int(1950, 2026)}),
            "offices": _array(_obj({"city": _str(12), "staff": _int(1, 5000)}), 3, 1),
        }
    ),
    "weather": _obj(
        {"city": _str(16), "celsius": _int(-50, 60), "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}}
    ),
    "entities": _obj({"people": _array(_str(16), 3), "places": _array(_str(16), 3), "dates": _array(_str(10), 2)}),
    "yes_no": _obj({"answer": {"enum": ["yes", "no"]}, "confidence": _int(0, 100)}),
    "nullable": _obj(
        {"nickname": {"anyOf": [_str(12), {"type": "null"}]}, "age": {"anyOf": [_int(0, 120), {"type": "null"}]}}
    ),
    "alternatives": _obj(
        {"contact": {"anyOf": [_obj({"email": _str(24)}), _obj({"phone": _str(12, pattern="^[0-9+ -]+$")})]}}
    ),
    "optional_fields": _obj(
        {"title": _str(20), "subtitle": _str(20), "pages": _int(1, 2000)}, optional=("subtitle", "pages")
    ),
    "matrix": _obj({"rows": _array(_array(_int(0, 9), 3, 3), 3, 3)}),
    "recipe": _obj(
        {
            "dish": _str(20),
            "ingredients": _array(_obj({"name": _str(12), "grams": _int(1, 1000)}), 5, 1),
            "minutes": _int(1, 240),
            "vegetarian": {"type": "boolean"},
        }
    ),
    "ticket": _obj(
        {
            "id": _int(1, 99999),
            "status": {"enum": ["open", "pending", "closed"]},
            "assignee": {"anyOf": [_str(12), {"type": "null"}]},
            "labels": _array(_str(10), 3),
        }
    ),
    "coordinates": _obj(
        {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180},
        }
    ),
    "const_version": _obj({"version": {"const": 2}, "kind": {"const": "report"}, "body": _str(24)}),
    "string_list": _array(_str(10), 5, 1),
    "flags": _obj({name: {"type": "boolean"} for name in ("admin", "beta", "verified", "banned")}),
    "review": _obj(
        {
            "stars": _int(1, 5),
            "pros": _array(_str(16), 3),
            "cons": _array(_str(16), 3),
            "recommend": {"type": "boolean"},
        }
    ),
    "invoice": _obj(
        {
            "number": _str(10, pattern="^INV-[0-9]{1,6}$"),
            "lines": _array(_obj({"text": _str(16), "amount": {"type": "number"}}), 3, 1),
            "currency": {"enum": ["USD", "EUR", "JPY"]},
            "paid": {"type": "boolean"},
        }
    ),
    "tree": _obj({"name": _str(8), "children": _array(_obj({"name": _str(8), "leaf": {"type": "boolean"}}), 3)}),
}

#: OpenAI ``tools`` for the tool-calling part: each function's parameters are a bounded schema.
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": _obj({"city": _str(16), "unit": {"enum": ["c", "f"]}}),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": _obj({"query": _str(24), "limit": _int(1, 10)}),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "send_email",
            "description": "Send an email.",
            "parameters": _obj({"to": _str(24), "subject": _str(20), "urgent": {"type": "boolean"}}),
        },
    },
]

#: User messages the requests cycle through (any text works: the grammar decides the shape).
PROMPTS = [
    "Extract the details from this text: Maria Lopez, 34, lives at 12 Oak Street in Lyon and ordered two lamps.",
    "Describe a product you would sell in a small shop, as JSON.",
    "Summarise yesterday's weather in Tokyo.",
    "Create a record for a customer support ticket about a failed payment.",
    "Give me a quick dinner idea.",
    "What's the weather in Berlin, and email the answer to my boss?",
]
