"""The ``ToolParser`` interface (slot ``tool_parser``): a model's own tool-call format turned into OpenAI
``tool_calls``, whole or as it streams.

With ``--enable-auto-tool-choice --tool-call-parser NAME`` (vLLM's flags) a chat request whose ``tool_choice`` is
``auto`` generates freely and the API front end parses its text with the parser: Hermes/Qwen's
``<tool_call>{json}</tool_call>``, Llama 3's bare JSON, Mistral's ``[TOOL_CALLS][...]``. ``ToolCallStream`` makes
OpenAI's streamed deltas of any parser (content first, then each call's id and name, then its arguments in
pieces). Imports no torch.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from tokenmill.parsers.json_calls import PartialCall

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments, the JSON text the model wrote."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ExtractedToolCalls:
    """What a parser made of a text: the calls, and the content beside them (the text before the first call;
    the whole text when there is no call)."""

    calls: list[ToolCall]
    content: str | None


@dataclass(frozen=True)
class PartialToolCalls:
    """What a parser makes of a text still being written: content safe to send (never text that could still
    turn out to be a call's marker) and the calls begun so far."""

    content: str
    calls: list[PartialCall]


class ToolParser(ABC):
    """Parses one model family's tool-call format (vLLM's ``ToolParser``).

    Built once per API front end process as ``cls(tokenizer)`` (plus ``options=`` when its plugin declares
    options), when ``parsers.tool_call_parser`` names it. Its methods run in the front end, on the event loop,
    once per finished choice (``extract_tool_calls``) or per streamed delta (``extract_tool_calls_streaming``):
    they must be pure string work (no I/O, no torch, no hooks).
    """

    #: Registered name.
    name: ClassVar[str]
    #: Whether the format's markers are special tokens that detokenization must keep: requests with tools then
    #: get ``skip_special_tokens=False`` (Mistral's ``[TOOL_CALLS]``).
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls in a finished output. Text that does not parse as the format's calls is content, whole:
        a malformed call is never an error."""

    @abstractmethod
    def extract_tool_calls_streaming(self, text: str) -> PartialToolCalls:
        """The content and calls of the output so far (``text`` grows by a delta each call). Each result's
        content and each call's arguments must extend the previous result's: they are sent as differences."""


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's ``message.tool_calls`` for ``calls``."""
    return [
        {"id": tool_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in calls
    ]


@dataclass
class ToolCallStream:
    """One choice's tool calls as they stream: ``feed`` the whole text so far, get the new OpenAI ``tool_calls``
    deltas (a call's id, type and name first, then pieces of its arguments). ``calls`` parses a text into the
    calls begun in it."""

    calls: Callable[[str], list[PartialCall]]
    _sent: list[int] = field(default_factory=list)  # per call: characters of its arguments sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self.deltas(self.calls(text))

    def deltas(self, calls: list[PartialCall]) -> list[dict[str, Any]]:
        """The deltas that bring what was sent up to ``calls``."""
        deltas = []
        for index, (name, arguments) in enumerate(calls):
            if index == len(self._sent):
                if name is None:
                    break
                self._sent.append(0)
                function = {"name": name, "arguments": ""}
                deltas.append({"index": index, "id": tool_call_id(), "type": "function", "function": function})
            if len(arguments) > self._sent[index]:
                deltas.append({"index": index, "function": {"arguments": arguments[self._sent[index] :]}})
                self._sent[index] = len(arguments)
        return deltas

    @property
    def num_calls(self) -> int:
        return len(self._sent)
