"""``<think>...</think>`` reasoning as vLLM's ``deepseek_r1`` and ``qwen3`` parsers split it.

The text before ``</think>`` is the reasoning (a ``<think>`` the model wrote itself is dropped), the text after it
the content. The two differ only for an output that never closes its thinking: DeepSeek-R1's is all reasoning
(its template opens the thinking in the prompt), Qwen3's all content (a Qwen3 model may not think at all). A
stream cannot wait for the end to know, so it sends text before ``</think>`` as reasoning with either parser.
Both markers must be single tokens of the model's vocabulary, as they are in these models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from tokenmill.parsers.json_calls import held_back
from tokenmill.parsers.reasoning_parser import ReasoningParser

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer


class ThinkingReasoningParser(ReasoningParser):
    """Reasoning between ``start_token`` and ``end_token`` (vLLM's ``BaseThinkingReasoningParser``)."""

    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"
    #: Whether an output without ``end_token`` is all reasoning (else all content).
    unterminated_is_reasoning: ClassVar[bool] = True

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        ids = {token: tokenizer.token_to_id(token) for token in (self.start_token, self.end_token)}
        missing = [token for token, token_id in ids.items() if token_id is None]
        if missing:
            raise ValueError(
                f"reasoning parser {self.name!r} needs {' and '.join(missing)} as single tokens of the model's "
                f"vocabulary ({tokenizer.path}); pick a reasoning parser for this model or none"
            )
        self.start_token_id = ids[self.start_token]
        self.end_token_id = ids[self.end_token]

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        for token_id in reversed(token_ids):  # the last marker tells
            if token_id == self.start_token_id:
                return False
            if token_id == self.end_token_id:
                return True
        return False

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        _, started, rest = text.partition(self.start_token)
        body = rest if started else text
        reasoning, ended, content = body.partition(self.end_token)
        if not ended:
            return (body, None) if self.unterminated_is_reasoning else (None, body or None)
        return reasoning, content or None

    def extract_reasoning_streaming(self, text: str) -> tuple[str, str]:
        index = text.find(self.start_token)
        body = text[index + len(self.start_token) :] if index >= 0 else text
        reasoning, ended, content = body.partition(self.end_token)
        if ended:
            return reasoning, content
        held = held_back(body, self.end_token)
        if index < 0:
            held = max(held, held_back(body, self.start_token))
        return body[: len(body) - held], ""


class DeepSeekR1ReasoningParser(ThinkingReasoningParser):
    name: ClassVar[str] = "deepseek_r1"


class Qwen3ReasoningParser(ThinkingReasoningParser):
    name: ClassVar[str] = "qwen3"
    unterminated_is_reasoning: ClassVar[bool] = False
