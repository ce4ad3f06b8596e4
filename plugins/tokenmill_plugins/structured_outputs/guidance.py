"""``GuidanceBackend``: structured outputs with llguidance (JSON schema, regex, choice, Lark and GBNF grammars).

llguidance compiles a grammar lazily, as its matcher meets it, so a new schema costs little before the first
token; ``validate`` runs the same checks the matcher would, without torch, so the API front end refuses a
constraint that cannot compile with a 400 before the request reaches an engine.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar

import llguidance

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar

if TYPE_CHECKING:
    import torch

    from tokenmill.tokenizer import Tokenizer


def _schema(params: StructuredOutputsParams) -> dict[str, Any] | str:
    if params.json_object:
        return {"type": "object"}
    assert params.json is not None
    if not params.disable_additional_properties:
        return params.json
    schema = json.loads(params.json) if isinstance(params.json, str) else params.json
    return _no_additional_properties(schema)


def _no_additional_properties(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that does not say (vLLM's
    ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [_no_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: _no_additional_properties(value) for key, value in schema.items()}
    if result.get("type") == "object" or "properties" in result:
        result.setdefault("additionalProperties", False)
    return result


def serialize_grammar(params: StructuredOutputsParams) -> str:
    """``params`` as an llguidance grammar (its JSON form); raises ``ValueError`` when it is not even well formed."""
    kind = params.kind
    if kind in ("json", "json_object"):
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        return llguidance.LLMatcher.grammar_from_json_schema(_schema(params), defaults=options)  # type: ignore[arg-type]
    if kind == "regex":
        assert params.regex is not None
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        assert params.choice is not None
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    assert params.grammar is not None
    return llguidance.grammar_from("grammar", params.grammar)


class GuidanceGrammar(StructuredOutputGrammar):
    """One request's ``llguidance.LLMatcher``."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return self.matcher.consume_tokens(token_ids) and not self.matcher.is_error()

    def validate_tokens(self, token_ids: list[int]) -> int:
        return self.matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        assert bitmask.dtype.itemsize == 4 and row.is_contiguous() and bitmask.device.type == "cpu"
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()


class GuidanceBackend(StructuredOutputBackend):
    """llguidance over the model's tokenizer (read once, from its ``tokenizer.json`` form)."""

    name: ClassVar[str] = "guidance"
    validates: ClassVar[bool] = True

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        n_vocab = max(vocab_size, tokenizer.vocab_size)
        self.ll_tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=list(tokenizer.eos_token_ids) or None
        )

    def validate(self, params: StructuredOutputsParams) -> None:
        grammar = self._serialize(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise ValueError(_one_line(messages[0]))

    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        grammar = self._serialize(params)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(_one_line(matcher.get_error()))
        return matcher  # never advanced: each request's matcher is a copy of it

    def grammar(self, compiled: Any) -> StructuredOutputGrammar:
        return GuidanceGrammar(compiled.deep_copy())

    def _serialize(self, params: StructuredOutputsParams) -> str:
        try:
            return serialize_grammar(params)
        except (ValueError, TypeError) as exc:
            raise ValueError(_one_line(str(exc))) from None


def _one_line(message: str) -> str:
    """llguidance's message, its first lines joined: an API error is one line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else "the grammar is invalid"
