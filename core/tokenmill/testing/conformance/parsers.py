"""``check_tool_parser`` and ``check_reasoning_parser``: a parser of a model's own output format, whole and
streamed, on outputs in that format which its author supplies.

The kit cannot write a model's format, so each check takes outputs as the model writes them. It checks what
every format shares: a stream's results only ever grow (they are sent as differences), and a stream cut into
pieces of any size joins, through the server's own streaming (``OutputParsing``), into what the whole output
parses to.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from tokenmill.parsers.reasoning_parser import ReasoningParser
from tokenmill.parsers.tool_parser import ExtractedToolCalls, PartialToolCalls, ToolParser
from tokenmill.server.parsing import OutputParsing
from tokenmill.testing.conformance._util import calling, conformance_check, fail, tiny_tokenizer
from tokenmill.tokenizer import Tokenizer

#: Prose no tool-call format takes for a call: content, whole, whatever the parser.
PLAIN_TEXTS = ("The weather is fine.", "It is 21 degrees today, so no umbrella (and no tools) needed.")
#: The sizes of the pieces a stream is cut into (and the whole text at once).
_PIECE_SIZES = (1, 3, 7, None)


@conformance_check
def check_tool_parser(
    parser: type[ToolParser] | Callable[[Tokenizer], ToolParser],
    outputs: Sequence[str],
    *,
    tokenizer: Tokenizer | None = None,
    added_tokens: Sequence[str] = (),
) -> None:
    """Check a tool-call parser on ``outputs`` (whole model outputs in its format; at least one with a call) and
    on ``PLAIN_TEXTS``:

    - ``extract_tool_calls`` gives each call a name and arguments that are a JSON object's text, the same each
      time; the plain texts are content, whole, with no call;
    - streamed in pieces of 1, 3 and 7 characters and whole, each ``extract_tool_calls_streaming`` result's
      content extends the previous one's, no call disappears, a call's name once known never changes, and its
      arguments extend the previous ones;
    - through ``OutputParsing``, the stream's content and calls join into the whole output's (unless the whole
      output's calls turn out malformed, and so content, after the stream began them: it could not know).

    :param parser: the class, built as the front end builds it (``parser(tokenizer)``), or any callable taking
        the tokenizer (``functools.partial(MyParser, options=...)``).
    :param tokenizer: the tokenizer to build it with; default: the kit's tiny one, with ``added_tokens``.
    :raises AssertionError: naming the output, the piece size and what differs.
    """
    candidate = parser(tokenizer or tiny_tokenizer(added_tokens))
    name = type(candidate).__name__
    num_calls = 0
    for text in (*outputs, *PLAIN_TEXTS):
        with calling(f"{name}.extract_tool_calls({text!r})"):
            extracted = candidate.extract_tool_calls(text)
            again = candidate.extract_tool_calls(text)
        if again != extracted:
            fail(f"{name}.extract_tool_calls({text!r}) gave {extracted!r}, then {again!r}")
        if text in PLAIN_TEXTS and extracted != ExtractedToolCalls([], text):
            fail(f"{name}.extract_tool_calls({text!r}) gave {extracted!r}; text without a call is content, whole")
        for call in extracted.calls:
            if not isinstance(call.name, str) or not call.name or not _is_json_object(call.arguments):
                fail(f"{name}.extract_tool_calls({text!r}) gave {call!r}: a call needs a name and arguments that "
                     "are a JSON object's text")  # fmt: skip
        num_calls += len(extracted.calls)
        for size in _PIECE_SIZES:
            _streams_grow(candidate, text, size)
            _stream_joins(OutputParsing(tool_parser=candidate), f"{name} on {text!r}", text, size)
    if not num_calls:
        fail(f"{name}: no call in any of the outputs given; give at least one output with a call")


@conformance_check
def check_reasoning_parser(
    parser: type[ReasoningParser] | Callable[[Tokenizer], ReasoningParser],
    outputs: Sequence[str],
    *,
    tokenizer: Tokenizer | None = None,
    added_tokens: Sequence[str] = (),
) -> None:
    """Check a reasoning parser on ``outputs`` (whole model outputs in its format; at least one with reasoning):

    - ``extract_reasoning`` gives ``(reasoning, content)``, strings or None, the same each time;
    - streamed in pieces of 1, 3 and 7 characters and whole, each ``extract_reasoning_streaming`` result's
      reasoning and content extend the previous one's;
    - through ``OutputParsing``, the stream's reasoning and content join into the whole output's split; where the
      whole split finds no reasoning (an output that never closed it, read as content), the stream may have sent
      that text as reasoning (it could not know), but every character of it.

    :param parser: the class, built as the front end builds it (``parser(tokenizer)``), or any callable taking
        the tokenizer.
    :param tokenizer: the tokenizer to build it with; default: the kit's tiny one, with ``added_tokens`` (a
        parser whose markers must be tokens: ``added_tokens=("<think>", "</think>")``).
    :raises AssertionError: naming the output, the piece size and what differs.
    """
    candidate = parser(tokenizer or tiny_tokenizer(added_tokens))
    name = type(candidate).__name__
    has_reasoning = False
    for text in outputs:
        with calling(f"{name}.extract_reasoning({text!r})"):
            split = candidate.extract_reasoning(text)
            again = candidate.extract_reasoning(text)
        if not (isinstance(split, tuple) and len(split) == 2 and all(p is None or isinstance(p, str) for p in split)):
            fail(f"{name}.extract_reasoning({text!r}) gave {split!r}; expected (reasoning, content), str or None")
        if again != split:
            fail(f"{name}.extract_reasoning({text!r}) gave {split!r}, then {again!r}")
        has_reasoning = has_reasoning or bool(split[0])
        for size in _PIECE_SIZES:
            where = f"{name}.extract_reasoning_streaming on {text!r} in pieces of {size or 'the whole text'}"
            previous = ("", "")
            for prefix in _prefixes(text, size):
                with calling(where):
                    result = candidate.extract_reasoning_streaming(prefix)
                for part, (now, before) in enumerate(zip(result, previous, strict=True)):
                    if not now.startswith(before):
                        fail(f"{where}: the {('reasoning', 'content')[part]} went from {before!r} to {now!r} at "
                             f"{prefix!r}; each result must extend the previous one")  # fmt: skip
                previous = result
            joined = _stream_joins(OutputParsing(reasoning=candidate), f"{name} on {text!r}", text, size)
            reasoning, content = split
            if reasoning is None and joined["reasoning_content"] + joined["content"] == (content or ""):
                continue  # streamed as reasoning, read whole as content: every character arrived
            if joined != {"reasoning_content": reasoning or "", "content": content or ""}:
                fail(f"{name} on {text!r} streamed in pieces of {size or 'the whole text'}: the stream joins into "
                     f"{joined!r}, the whole output splits into {split!r}")  # fmt: skip
    if not has_reasoning:
        fail(f"{name}: no reasoning in any of the outputs given; give at least one output with reasoning")


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (TypeError, ValueError):
        return False


def _prefixes(text: str, size: int | None) -> list[str]:
    """The text so far after each piece of ``size`` characters (None: the whole text at once)."""
    step = size or max(len(text), 1)
    return [text[: end + step] for end in range(0, len(text), step)]


def _streams_grow(parser: ToolParser, text: str, size: int | None) -> None:
    where = f"{type(parser).__name__}.extract_tool_calls_streaming on {text!r} in pieces of {size or 'the whole text'}"
    previous = PartialToolCalls("", [])
    for prefix in _prefixes(text, size):
        with calling(where):
            result = parser.extract_tool_calls_streaming(prefix)
        at = f"{where}: at {prefix!r}"
        if not result.content.startswith(previous.content):
            fail(f"{at}, the content went from {previous.content!r} to {result.content!r}; it must only grow")
        if len(result.calls) < len(previous.calls):
            fail(f"{at}, {len(previous.calls)} calls became {len(result.calls)}; a call once begun stays")
        for index, ((name, arguments), (name_before, arguments_before)) in enumerate(
            zip(result.calls, previous.calls, strict=False)
        ):
            if name_before is not None and name != name_before:
                fail(f"{at}, call {index}'s name went from {name_before!r} to {name!r}")
            if not arguments.startswith(arguments_before):
                fail(f"{at}, call {index}'s arguments went from {arguments_before!r} to {arguments!r}; they must "
                     "only grow")  # fmt: skip
        previous = result


def _stream_joins(parsing: OutputParsing, where: str, text: str, size: int | None) -> dict[str, str]:
    """``text`` streamed through ``parsing`` in pieces of ``size``: the joined reasoning and content, after the
    stream's calls are compared with the whole output's."""
    where = f"{where} streamed in pieces of {size or 'the whole text'}"
    stream = parsing.stream()
    deltas: list[dict[str, Any]] = []
    with calling(where):
        for prefix in _prefixes(text, size):
            deltas += stream.feed(prefix[len(stream.text) :])
        deltas += stream.finish()
        message, _ = parsing.message(text)
    joined = {"content": "", "reasoning_content": ""}
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            if "id" in call:
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"]["arguments"]
        for key in joined:
            joined[key] += delta.get(key, "")
    whole_calls = [dict(call["function"]) for call in message.get("tool_calls", [])]
    if calls and not whole_calls:
        return joined  # calls that turned out malformed at the end: the stream could not know, the whole is content
    if [calls[index] for index in sorted(calls)] != whole_calls:
        fail(f"{where}: the stream's calls join into {[calls[i] for i in sorted(calls)]!r}, the whole output's are "
             f"{whole_calls!r}")  # fmt: skip
    if parsing.reasoning is None and joined["content"] != (message["content"] or ""):
        fail(f"{where}: the stream's content joins into {joined['content']!r}, the whole output's is "
             f"{message['content']!r}")  # fmt: skip
    return joined
