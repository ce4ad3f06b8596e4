"""The first-party tool-call parsers on the formats their models write (Qwen 2.5/3 and Hermes, Llama 3.x JSON,
Mistral), whole and streamed: a stream's pieces, joined, are what the whole response says, however the text is
cut into deltas; malformed calls are content."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenmill_plugins.parsers.tool_parsers import HermesToolParser, Llama3JsonToolParser, MistralToolParser

from tokenmill.parsers.tool_parser import ToolParser
from tokenmill.plugin_manager import Slot, load_plugins
from tokenmill.server.parsing import OutputParsing
from tokenmill.tokenizer import Tokenizer

WEATHER = '{"location": "San Francisco, CA", "unit": "celsius"}'
QWEN_TWO_CALLS = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": ' + WEATHER + "}\n</tool_call>\n"
    '<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA", '
    '"date": "2024-10-01", "unit": "celsius"}}\n</tool_call>'
)

CUT_SHORT = '[TOOL_CALLS][{"name": "a", "arguments": {"x": '

# (parser, output, expected content, expected [(name, arguments)]); arguments as written.
CASES: list[tuple[type[ToolParser], str, str | None, list[tuple[str, str]]]] = [
    (HermesToolParser, QWEN_TWO_CALLS, None,
     [("get_current_temperature", WEATHER),
      ("get_temperature_date", '{"location": "San Francisco, CA", "date": "2024-10-01", "unit": "celsius"}')]),
    (HermesToolParser, 'Let me check.\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
     "Let me check.\n\n", [("f", "{}")]),
    (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}\n</tool_call>', None,
     [("f", '{"a": [1, {"b": "}"}]}')]),
    (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),  # unclosed
    (HermesToolParser, "The weather is fine.", "The weather is fine.", []),
    (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>', []),  # malformed: content
    (HermesToolParser, "<tool_call>\n[1, 2]\n</tool_call>", "<tool_call>\n[1, 2]\n</tool_call>", []),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": ' + WEATHER + "}", None,
     [("get_weather", WEATHER)]),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}',
     None, [("a", '{"x": 1}'), ("b", "{}")]),
    (Llama3JsonToolParser, "Paris is the capital.", "Paris is the capital.", []),
    (Llama3JsonToolParser, '{"answer": 42}', '{"answer": 42}', []),  # JSON, not a call
    (Llama3JsonToolParser, '{"name": "a", "parameters": {"x": 1}', '{"name": "a", "parameters": {"x": 1}', []),
    (MistralToolParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER + "}]", None,
     [("get_weather", WEATHER)]),
    (MistralToolParser, 'Sure.[TOOL_CALLS] [{"name": "a", "arguments": {"x": "y"}}, {"name": "b", "arguments": {}}]',
     "Sure.", [("a", '{"x": "y"}'), ("b", "{}")]),
    (MistralToolParser, "No tools needed.", "No tools needed.", []),
    (MistralToolParser, CUT_SHORT, CUT_SHORT, []),
    # Tokenizers v11 and later (Mistral Small 3.1+, Magistral, Devstral): one marker per call, the name first.
    (MistralToolParser, "[TOOL_CALLS]get_weather[ARGS]" + WEATHER, None, [("get_weather", WEATHER)]),
    (MistralToolParser, 'Sure.[TOOL_CALLS]a[ARGS]{"x": "y"}[TOOL_CALLS]b[ARGS]{}', "Sure.",
     [("a", '{"x": "y"}'), ("b", "{}")]),
    (MistralToolParser, '[TOOL_CALLS]a[CALL_ID]Ab3dE9xYz[ARGS]{"x": [1, {"y": "}"}]}', None,
     [("a", '{"x": [1, {"y": "}"}]}')]),
    (MistralToolParser, '[TOOL_CALLS]get_time{"zone": "UTC"}', None, [("get_time", '{"zone": "UTC"}')]),  # no [ARGS]
    (MistralToolParser, '[TOOL_CALLS]a[ARGS]{"x": ', '[TOOL_CALLS]a[ARGS]{"x": ', []),  # cut short: content
    (MistralToolParser, "[TOOL_CALLS]a[ARGS][1, 2]", "[TOOL_CALLS]a[ARGS][1, 2]", []),  # arguments not an object
]  # fmt: skip


def _ids(case: tuple[type[ToolParser], str, str | None, list[tuple[str, str]]]) -> str:
    return f"{case[0].name}:{case[1][:30]}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_whole_outputs(case: tuple[type[ToolParser], str, str | None, list[tuple[str, str]]],
                       tokenizer: Tokenizer) -> None:  # fmt: skip
    parser_type, text, content, calls = case
    extracted = parser_type(tokenizer).extract_tool_calls(text)
    assert extracted.content == content
    assert [(c.name, c.arguments) for c in extracted.calls] == calls
    for call in extracted.calls:
        assert isinstance(json.loads(call.arguments), dict)


def _stream(parsing: OutputParsing, text: str, size: int) -> tuple[dict[str, str], list[dict[str, str]], bool]:
    """``text`` streamed in pieces of ``size`` characters: the joined reasoning/content, the joined calls, and
    whether the stream called tools."""
    stream = parsing.stream()
    parts: list[dict[str, Any]] = []
    for start in range(0, len(text), size):
        parts += stream.feed(text[start : start + size])
    parts += stream.finish()
    joined = {"content": "", "reasoning_content": ""}
    calls: dict[int, dict[str, str]] = {}
    for part in parts:
        assert len(part) == 1, part
        for call in part.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            if "id" in call:
                assert call["type"] == "function" and not entry["name"]
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"]["arguments"]
        for key in ("content", "reasoning_content"):
            joined[key] += part.get(key, "")
    return joined, [calls[i] for i in sorted(calls)], stream.called_tools


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize("case", [c for c in CASES if c[3]], ids=[_ids(c) for c in CASES if c[3]])
def test_streams_reassemble_into_the_whole_response(
    case: tuple[type[ToolParser], str, str | None, list[tuple[str, str]]], size: int, tokenizer: Tokenizer
) -> None:
    parser_type, text, _, _ = case
    parsing = OutputParsing(tool_parser=parser_type(tokenizer))
    message, called = parsing.message(text)
    joined, calls, streamed_calls = _stream(parsing, text, size)
    assert called and streamed_calls
    assert joined["content"] == (message["content"] or "")
    assert calls == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in message["tool_calls"]]  # fmt: skip


@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.parametrize("text", ["The weather is fine.", "a <tool_ok> b", "<tool", "Use [TOOL_CALL"])
def test_text_without_calls_streams_whole_as_content(text: str, size: int, tokenizer: Tokenizer) -> None:
    for parser_type in (HermesToolParser, Llama3JsonToolParser, MistralToolParser):
        joined, calls, called = _stream(OutputParsing(tool_parser=parser_type(tokenizer)), text, size)
        assert (joined["content"], calls, called) == (text, [], False)


def test_the_parsers_plugin_registers_vllms_names() -> None:
    plugins = load_plugins()
    assert {"hermes", "llama3_json", "mistral"} <= set(plugins.registry.names(Slot.TOOL_PARSER))
    assert {"deepseek_r1", "qwen3"} <= set(plugins.registry.names(Slot.REASONING_PARSER))
    assert plugins.load(Slot.TOOL_PARSER, "mistral").keeps_special_tokens
