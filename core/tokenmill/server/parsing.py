"""Chat outputs read by the server's parsers: a reasoning model's thinking into ``reasoning_content``, tool calls
(forced by the grammar, or found by the tool-call parser when ``tool_choice`` is ``auto``) into ``tool_calls``;
whole, and as the deltas of a stream (text before the calls as content, then each call's id and name, then its
arguments in pieces, as OpenAI sends them).

``ServerParsers`` is built once per API front end from ``config.parsers``; ``for_request`` says how one request's
outputs are read (``OutputParsing``, None when they are plain text). Imports no torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.parsers.reasoning_parser import ReasoningParser
from tokenmill.parsers.tool_parser import PartialToolCalls, ToolCallStream, ToolParser, openai_tool_calls
from tokenmill.plugin_manager import PluginSystem, Slot
from tokenmill.sampling_params import SamplingParams
from tokenmill.server import tools
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputParsing:
    """How one chat request's outputs are read: split by ``reasoning`` (unless its prompt already closed the
    reasoning), then read as ``forced`` tool calls or by ``tool_parser``."""

    reasoning: ReasoningParser | None = None
    tool_parser: ToolParser | None = None
    forced: tools.ForcedToolCall | None = None

    def split(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a finished output."""
        return self.reasoning.extract_reasoning(text) if self.reasoning is not None else (None, text)

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """A finished output's message fields (``content``, ``reasoning_content``, ``tool_calls``) and whether
        it called tools. A forced call's output that does not parse (cut short by ``max_tokens``) stays content."""
        reasoning, content = self.split(text)
        fields: dict[str, Any] = {"content": content}
        if self.reasoning is not None:
            fields["reasoning_content"] = reasoning
        calls: list[dict[str, Any]] | None = None
        if self.forced is not None:
            calls = tools.tool_calls(self.forced, content or "")
            if calls is not None:
                fields["content"] = None
        elif self.tool_parser is not None and content is not None:
            extracted = self.tool_parser.extract_tool_calls(content)
            if extracted.calls:
                calls = openai_tool_calls(extracted.calls)
                fields["content"] = extracted.content
        if calls is not None:
            fields["tool_calls"] = calls
        return fields, bool(calls)

    def apply(self, response: dict[str, Any]) -> None:
        """Rewrite each choice of a finished chat response with its parsed message; a choice that called tools
        and stopped finishes with ``tool_calls``."""
        for choice in response["choices"]:
            message = choice["message"]
            fields, called = self.message(message["content"] or "")
            message.update(fields)
            if called and choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"

    def stream(self) -> ChoiceStream:
        """The stream state of one choice."""
        return ChoiceStream(self)


@dataclass
class ChoiceStream:
    """One choice's parsed stream: ``feed`` each text delta, ``finish`` at its end; each returns the chat
    ``delta`` objects to send (``reasoning_content``, ``content`` or one ``tool_calls`` entry each)."""

    parsing: OutputParsing
    text: str = ""
    reasoning_sent: str = ""
    content_sent: str = ""
    calls: ToolCallStream = field(init=False)

    def __post_init__(self) -> None:
        forced = self.parsing.forced
        self.calls = ToolCallStream(tools.forced_calls(forced) if forced is not None else lambda text: [])

    @property
    def called_tools(self) -> bool:
        return self.calls.num_calls > 0

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        self.text += delta_text
        reasoning = self.parsing.reasoning
        if reasoning is None:
            return self._content(self.text, final=False)
        thought, content = reasoning.extract_reasoning_streaming(self.text)
        return self._reasoning(thought) + self._content(content, final=False)

    def finish(self) -> list[dict[str, Any]]:
        """What was held back (a possible marker's start), and a final read of the calls."""
        thought, content = self.parsing.split(self.text)
        if self.parsing.reasoning is not None and not (thought or "").startswith(self.reasoning_sent):
            # Streamed as reasoning, read whole as content (Qwen3 that never closed its thinking): the stream
            # keeps its view, and the rest of the text is reasoning too.
            start = self.text.find(self.reasoning_sent)
            thought, content = self.text[start:] if start >= 0 else self.reasoning_sent, self.content_sent
        return self._reasoning(thought or "") + self._content(content or "", final=True)

    def _reasoning(self, thought: str) -> list[dict[str, Any]]:
        if len(thought) <= len(self.reasoning_sent) or not thought.startswith(self.reasoning_sent):
            return []
        delta = thought[len(self.reasoning_sent) :]
        self.reasoning_sent = thought
        return [{"reasoning_content": delta}]

    def _content(self, content: str, final: bool) -> list[dict[str, Any]]:
        parser = self.parsing.tool_parser
        if self.parsing.forced is not None:
            return [{"tool_calls": [call]} for call in self.calls.feed(content)]
        partial = PartialToolCalls(content, [])
        if parser is not None and not final:
            partial = parser.extract_tool_calls_streaming(content)
        elif parser is not None:
            extracted = parser.extract_tool_calls(content)
            if extracted.calls:
                partial = PartialToolCalls(extracted.content or "", [(c.name, c.arguments) for c in extracted.calls])
            elif self.called_tools:
                return []  # calls went out and the whole text turned out not to parse: nothing to add
        deltas: list[dict[str, Any]] = []
        if len(partial.content) > len(self.content_sent) and partial.content.startswith(self.content_sent):
            deltas.append({"content": partial.content[len(self.content_sent) :]})
            self.content_sent = partial.content
        return deltas + [{"tool_calls": [call]} for call in self.calls.deltas(partial.calls)]


class ServerParsers:
    """The front end's tool-call and reasoning parsers (``config.parsers``), built once at start-up; a parser
    that cannot work with the model (its markers are not tokens) fails the start with its message."""

    def __init__(self, config: EngineConfig, plugins: PluginSystem | None, tokenizer: Tokenizer) -> None:
        settings = config.parsers
        #: ``tool_choice: "auto"`` is allowed (``--enable-auto-tool-choice``).
        self.auto_tool_choice = settings.enable_auto_tool_choice
        self.tool_parser: ToolParser | None = None
        self.reasoning: ReasoningParser | None = None
        if settings.tool_call_parser is None and settings.reasoning_parser is None:
            return
        if plugins is None:
            from tokenmill.plugin_manager import resolve_plugins

            plugins = resolve_plugins(config)
        if settings.tool_call_parser is not None:
            self.tool_parser = plugins.create(Slot.TOOL_PARSER, settings.tool_call_parser, tokenizer)
        if settings.reasoning_parser is not None:
            self.reasoning = plugins.create(Slot.REASONING_PARSER, settings.reasoning_parser, tokenizer)

    def for_request(
        self, tool_choice: Any, has_tools: bool, forced: tools.ForcedToolCall | None, prompt_token_ids: list[int]
    ) -> OutputParsing | None:
        """How a chat request's outputs are read (None: as plain text)."""
        reasoning = self.reasoning
        if reasoning is not None and reasoning.is_reasoning_end(prompt_token_ids):
            reasoning = None  # the chat template closed the thinking in the prompt (thinking off): all content
        auto = self.tool_parser if has_tools and tool_choice in (None, "auto") and self.auto_tool_choice else None
        if reasoning is None and auto is None and forced is None:
            return None
        return OutputParsing(reasoning, auto, forced)

    def sampling_params(self, params: SamplingParams, parsing: OutputParsing | None) -> SamplingParams:
        """``params`` for a request read with ``parsing``: special tokens kept when the tool-call format's markers
        are special tokens."""
        if parsing is not None and parsing.tool_parser is not None and parsing.tool_parser.keeps_special_tokens:
            return msgspec.structs.replace(params, skip_special_tokens=False)
        return params
