"""Tool-call formats as vLLM's parsers of the same names read them.

- ``hermes``: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per call (Hermes 2/3,
  Qwen 2.5, Qwen3); the text before the first block is the content.
- ``llama3_json``: an output that is one or more ``{"name": "f", "parameters": {...}}`` objects (``arguments``
  also read), separated by ``;``, optionally after ``<|python_tag|>`` (Llama 3.1-3.3); no content beside them.
- ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (tokenizers before v11), or one
  ``[TOOL_CALLS]f[ARGS]{...}`` per call (v11 and later: Mistral Small 3.1+, Magistral, Devstral; an optional
  ``[CALL_ID]id`` after the name, and ``[ARGS]`` absent in some); the text before the first marker is the
  content. The markers are special tokens, so requests with tools keep special tokens in their text.

A call's arguments are the JSON text the model wrote (streamed pieces join into exactly that text). An output
whose calls do not parse is content, whole.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from tokenmill.parsers.json_calls import PartialCall, held_back, scan_calls, value_end
from tokenmill.parsers.tool_parser import ExtractedToolCalls, PartialToolCalls, ToolCall, ToolParser


def _call(value: Any, scanned: PartialCall | None, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """The call ``value`` (a decoded JSON object) makes, or None when it is not one; ``scanned`` is what
    ``scan_calls`` read of its text, whose arguments are kept as written when they decode to the same value."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in argument_keys if k in value), None)
    arguments = value[key] if key is not None else {}
    if not isinstance(arguments, dict):
        return None
    raw = scanned[1] if scanned is not None and scanned[0] == value["name"] else ""
    try:
        written = bool(raw) and json.loads(raw) == arguments
    except ValueError:
        written = False
    return ToolCall(value["name"], raw if written else json.dumps(arguments, ensure_ascii=False))


def _first(calls: list[PartialCall]) -> PartialCall | None:
    return calls[0] if calls else None


def _objects(text: str) -> list[tuple[Any, str]] | None:
    """The JSON values ``text`` is made of (separated by whitespace or ``;``), each with its text; None when
    something else is in it."""
    decoder = json.JSONDecoder()
    values: list[tuple[Any, str]] = []
    position = 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] == ";"):
            position += 1
        if position == len(text):
            return values
        try:
            value, end = decoder.raw_decode(text, position)
        except ValueError:
            return None
        values.append((value, text[position:end]))
        position = end


class HermesToolParser(ToolParser):
    name: ClassVar[str] = "hermes"
    start: ClassVar[str] = "<tool_call>"
    end: ClassVar[str] = "</tool_call>"

    def _blocks(self, text: str, first: int) -> list[str]:
        pattern = re.escape(self.start) + r"(.*?)" + re.escape(self.end) + "|" + re.escape(self.start) + r"(.*)"
        return [closed if closed else open_ for closed, open_ in re.findall(pattern, text[first:], re.DOTALL)]

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        first = text.find(self.start)
        if first < 0:
            return ExtractedToolCalls([], text)
        calls = []
        for block in self._blocks(text, first):
            values = _objects(block)
            call = None
            if values and len(values) == 1:
                call = _call(values[0][0], _first(scan_calls(values[0][1])), ("arguments",))
            if call is None:
                return ExtractedToolCalls([], text)
            calls.append(call)
        return ExtractedToolCalls(calls, text[:first] or None)

    def extract_tool_calls_streaming(self, text: str) -> PartialToolCalls:
        first = text.find(self.start)
        if first < 0:
            return PartialToolCalls(text[: len(text) - held_back(text, self.start)], [])
        calls: list[PartialCall] = []
        for block in self._blocks(text, first):
            calls += scan_calls(block, ("arguments",))[:1]
        return PartialToolCalls(text[:first], calls)


class Llama3JsonToolParser(ToolParser):
    name: ClassVar[str] = "llama3_json"
    python_tag: ClassVar[str] = "<|python_tag|>"
    argument_keys: ClassVar[tuple[str, ...]] = ("parameters", "arguments")

    def _body(self, text: str) -> str | None:
        """The text after an optional ``<|python_tag|>`` when it starts like a call, else None."""
        body = text.lstrip()
        body = body.removeprefix(self.python_tag).lstrip()
        return body if body.startswith("{") else None

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = self._body(text)
        values = _objects(body) if body is not None else None
        if not values:
            return ExtractedToolCalls([], text)
        keys = self.argument_keys
        calls = [_call(value, _first(scan_calls(source, keys)), keys) for value, source in values]
        if any(call is None for call in calls):
            return ExtractedToolCalls([], text)
        return ExtractedToolCalls([call for call in calls if call is not None], None)

    def extract_tool_calls_streaming(self, text: str) -> PartialToolCalls:
        stripped = text.lstrip()
        if not stripped or self.python_tag.startswith(stripped) or self.python_tag.lstrip() == stripped:
            return PartialToolCalls("", [])  # not yet known whether a call starts
        body = self._body(text)
        if body is None:
            return PartialToolCalls(text, [])
        return PartialToolCalls("", scan_calls(body, self.argument_keys))


#: The head of a v11+ Mistral call: its name, an optional call id and ``[ARGS]``, up to the arguments' ``{``.
_MISTRAL_HEAD = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\][A-Za-z0-9]*)?\s*(?:\[ARGS\])?\s*(?=\{)")


class MistralToolParser(ToolParser):
    name: ClassVar[str] = "mistral"
    keeps_special_tokens: ClassVar[bool] = True
    marker: ClassVar[str] = "[TOOL_CALLS]"

    @staticmethod
    def _is_v11(after_marker: str) -> bool:
        """Whether the text after the first marker is the v11+ form (a name), not a JSON list or object."""
        head = after_marker.lstrip()
        return bool(head) and head[0] not in "[{"

    def _v11_calls(self, text: str) -> list[ToolCall] | None:
        """The calls of a finished v11+ output (``text`` from its first marker), or None if one does not parse."""
        calls = []
        for segment in text.split(self.marker)[1:]:
            head = _MISTRAL_HEAD.match(segment)
            values = _objects(segment[head.end() :]) if head is not None else None
            if head is None or not values or len(values) != 1 or not isinstance(values[0][0], dict):
                return None
            calls.append(ToolCall(head.group(1), values[0][1]))
        return calls

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        index = text.find(self.marker)
        if index >= 0 and self._is_v11(text[index + len(self.marker) :]):
            v11 = self._v11_calls(text[index:])
            return ExtractedToolCalls(v11, text[:index] or None) if v11 else ExtractedToolCalls([], text)
        values = _objects(text[index + len(self.marker) :]) if index >= 0 else None
        if not values or len(values) != 1:
            return ExtractedToolCalls([], text)
        value, source = values[0]
        items = [value] if isinstance(value, dict) else value if isinstance(value, list) else []
        scanned = scan_calls(source)
        calls = [_call(item, scanned[i] if i < len(scanned) else None, ("arguments",)) for i, item in enumerate(items)]
        if not calls:
            return ExtractedToolCalls([], text)
        if any(call is None for call in calls):
            return ExtractedToolCalls([], text)
        return ExtractedToolCalls([call for call in calls if call is not None], text[:index] or None)

    def extract_tool_calls_streaming(self, text: str) -> PartialToolCalls:
        index = text.find(self.marker)
        if index < 0:
            return PartialToolCalls(text[: len(text) - held_back(text, self.marker)], [])
        after = text[index + len(self.marker) :]
        if not self._is_v11(after):
            return PartialToolCalls(text[:index], scan_calls(text, ("arguments",), index + len(self.marker)))
        calls: list[PartialCall] = []
        for segment in after.split(self.marker):
            head = _MISTRAL_HEAD.match(segment)
            if head is None:  # the name or what follows it is still being written
                calls.append((None, ""))
                continue
            end = value_end(segment, head.end())
            calls.append((head.group(1), segment[head.end() : end if end is not None else len(segment)]))
        return PartialToolCalls(text[:index], calls)
