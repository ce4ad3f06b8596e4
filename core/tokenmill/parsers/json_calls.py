"""Scanning JSON tool calls as the model writes them: ``{"name": ..., "arguments": ...}`` objects whose name is
known once its string is complete and whose arguments are the text written so far.

Streaming sends a call's arguments as the model wrote them (a prefix of the final text at every step), so the
pieces a client joins are exactly what a whole response carries. Pure functions; no torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

#: A call begun in a text: its name (None until the name's string is complete) and its arguments so far.
PartialCall = tuple[str | None, str]


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at ``text[start]`` ends (one past it), or None when it is incomplete."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif char == '"':
            in_string = True
        elif depth == 0 and i > start and char in ",;}] \t\r\n":  # the end of a number, true, false or null
            return i
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _key_value(text: str, position: int, keys: Sequence[str]) -> tuple[int, int | None] | None:
    """The start and end (None while incomplete) of the value of the first of ``keys`` after ``position``."""
    found = [(index, key) for key in keys if (index := text.find(f'"{key}"', position)) >= 0]
    if not found:
        return None
    index, key = min(found)
    colon = text.find(":", index + len(key) + 2)
    start = next((i for i in range(colon + 1, len(text)) if not text[i].isspace()), None) if colon >= 0 else None
    if start is None:
        return None
    return start, value_end(text, start)


def scan_calls(text: str, argument_keys: Sequence[str] = ("arguments",), start: int = 0) -> list[PartialCall]:
    """``(name, arguments so far)`` of each ``{"name": ..., <argument key>: ...}`` call begun in ``text`` from
    ``start``, in order; the last may be incomplete (name None, or arguments cut short)."""
    calls: list[PartialCall] = []
    position = start
    while True:
        name_value = _key_value(text, position, ("name",))
        if name_value is None:
            if text.find('"name"', position) >= 0:
                calls.append((None, ""))
            return calls
        name_start, name_end = name_value
        if name_end is None or text[name_start] != '"':
            calls.append((None, ""))
            return calls
        name = json.loads(text[name_start:name_end])
        arguments = _key_value(text, name_end, argument_keys)
        if arguments is None:
            calls.append((name, ""))
            return calls
        arguments_start, arguments_end = arguments
        calls.append((name, text[arguments_start : arguments_end if arguments_end is not None else len(text)]))
        if arguments_end is None:
            return calls
        position = arguments_end


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (kept back from a stream
    until the next piece tells)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
