"""The ``ReasoningParser`` interface (slot ``reasoning_parser``): a reasoning model's thinking split from its
answer, into OpenAI-style ``reasoning_content`` (vLLM's field) and ``content``.

With ``--reasoning-parser NAME`` the API front end splits every chat output (whole, or its streamed deltas),
and the engine starts a structured-output constraint only once the reasoning has ended (vLLM's behaviour): the
model thinks freely, then its answer follows the grammar. Imports no torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer


class ReasoningParser(ABC):
    """Splits one model family's thinking from its answer (vLLM's ``ReasoningParser``).

    Built once per process that needs it as ``cls(tokenizer)`` (plus ``options=`` when its plugin declares
    options): by the API front end, and by the engine, in a worker thread, on its first constrained request.
    Raises ``ValueError`` naming the tokens when the model's vocabulary lacks its markers. Every method is pure
    work on strings or token ids (no I/O, no torch, no hooks); the engine calls ``is_reasoning_end`` once per
    constrained request's token while it reasons.
    """

    #: Registered name.
    name: ClassVar[str]

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the reasoning has ended by the end of ``token_ids``: the prompt's (a chat template that turned
        thinking off closes it there), or one generated token (the engine checks each)."""

    @abstractmethod
    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a finished output, either None when absent."""

    @abstractmethod
    def extract_reasoning_streaming(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` of the output so far (``text`` grows by a delta each call), never counting
        text that could still be a marker's start; each result must extend the previous one (they are sent as
        differences)."""
