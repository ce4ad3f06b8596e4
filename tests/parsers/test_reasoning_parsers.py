"""``<think>...</think>`` split into ``reasoning_content`` by ``deepseek_r1`` and ``qwen3`` as vLLM's parsers
split it, whole and streamed (pieces of any size join into the whole split), together with tool calls; a prompt
that closed the thinking (a template with thinking off) leaves the output content; the markers must be tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenmill_plugins.parsers.reasoning_parsers import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from tokenmill_plugins.parsers.tool_parsers import HermesToolParser

from tests.parsers.test_tool_parsers import _stream
from tokenmill.config import load_config
from tokenmill.server.parsing import OutputParsing, ServerParsers
from tokenmill.server.tools import ForcedToolCall
from tokenmill.testing import save_tiny_model
from tokenmill.tokenizer import Tokenizer

PARSERS = [DeepSeekR1ReasoningParser, Qwen3ReasoningParser]
CALL = '<tool_call>\n{"name": "f", "arguments": {"q": "x"}}\n</tool_call>'

# (output, (reasoning, content) for deepseek_r1, for qwen3)
CASES = [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", ("\nThe user greets me.\n", "\n\nHello!")),
    ("Okay, 2 + 2 = 4.\n</think>\n\n4", ("Okay, 2 + 2 = 4.\n", "\n\n4")),  # the template opened the thinking
    ("<think></think>Done.", ("", "Done.")),
    ("<think>only thinking</think>", ("only thinking", None)),
    ("a</b> <thin </think>c", ("a</b> <thin ", "c")),
]


@pytest.mark.parametrize("parser_type", PARSERS)
@pytest.mark.parametrize(("text", "split"), CASES)
def test_whole_outputs(parser_type: type, text: str, split: tuple[str, str | None], tokenizer: Tokenizer) -> None:
    assert parser_type(tokenizer).extract_reasoning(text) == split


def test_an_output_that_never_closes_its_thinking(tokenizer: Tokenizer) -> None:
    text = "<think>Still thinking about"
    assert DeepSeekR1ReasoningParser(tokenizer).extract_reasoning(text) == ("Still thinking about", None)
    assert Qwen3ReasoningParser(tokenizer).extract_reasoning(text) == (None, "Still thinking about")
    assert Qwen3ReasoningParser(tokenizer).extract_reasoning("Hi!") == (None, "Hi!")


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize("parser_type", PARSERS)
@pytest.mark.parametrize(("text", "split"), CASES)
def test_streams_reassemble_into_the_whole_split(
    parser_type: type, text: str, split: tuple[str, str | None], size: int, tokenizer: Tokenizer
) -> None:
    parsing = OutputParsing(reasoning=parser_type(tokenizer))
    message, _ = parsing.message(text)
    joined, _, _ = _stream(parsing, text, size)
    assert joined == {"reasoning_content": message["reasoning_content"] or "", "content": message["content"] or ""}


def test_an_unclosed_stream_keeps_every_character(tokenizer: Tokenizer) -> None:
    """Qwen3's stream cannot know the thinking never closes: it stays reasoning, and what was held back (a
    possible marker) still goes out at the end."""
    joined, _, _ = _stream(OutputParsing(reasoning=Qwen3ReasoningParser(tokenizer)), "<think>abc </thi", 3)
    assert joined == {"reasoning_content": "abc </thi", "content": ""}


@pytest.mark.parametrize("size", [1, 6, 1000])
def test_reasoning_then_tool_calls(size: int, tokenizer: Tokenizer) -> None:
    parsing = OutputParsing(reasoning=Qwen3ReasoningParser(tokenizer), tool_parser=HermesToolParser(tokenizer))
    text = f"<think>I should search.</think>\n\nSearching.\n{CALL}"
    message, called = parsing.message(text)
    assert called and message["reasoning_content"] == "I should search."
    assert message["content"] == "\n\nSearching.\n"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("f", '{"q": "x"}')]
    joined, calls, streamed_calls = _stream(parsing, text, size)
    assert streamed_calls and calls == [{"name": "f", "arguments": '{"q": "x"}'}]
    assert joined == {"reasoning_content": "I should search.", "content": "\n\nSearching.\n"}


def test_reasoning_then_a_forced_call(tokenizer: Tokenizer) -> None:
    """With ``tool_choice`` required the grammar starts after the thinking: the calls are read from the content."""
    parsing = OutputParsing(reasoning=Qwen3ReasoningParser(tokenizer), forced=ForcedToolCall())
    text = '<think>hm</think>[{"name": "f", "parameters": {"q": 1}}]'
    message, called = parsing.message(text)
    assert called and message["content"] is None and message["reasoning_content"] == "hm"
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"q": 1}'}
    joined, calls, _ = _stream(parsing, text, 4)
    assert joined["reasoning_content"] == "hm" and calls == [{"name": "f", "arguments": '{"q": 1}'}]


def test_a_prompt_that_closed_the_thinking_leaves_content(qwen_like_model: Path, tokenizer: Tokenizer) -> None:
    config = load_config(overrides={"model": {"model": str(qwen_like_model)}, "parsers": {"reasoning_parser": "qwen3"}})
    parsers = ServerParsers(config, None, tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    thinking = tokenizer.apply_chat_template(messages, tokenize=True)
    not_thinking = tokenizer.apply_chat_template(messages, tokenize=True, enable_thinking=False)
    assert isinstance(thinking, list) and isinstance(not_thinking, list)
    parsing = parsers.for_request(None, False, None, thinking)
    assert parsing is not None and parsing.reasoning is not None
    assert parsers.for_request(None, False, None, not_thinking) is None


def test_a_model_without_the_markers_is_refused_by_name(tmp_path: Path) -> None:
    plain = Tokenizer.from_path(save_tiny_model(tmp_path / "plain"))
    with pytest.raises(ValueError, match="<think> and </think> as single tokens"):
        Qwen3ReasoningParser(plain)
