"""``XgrammarBackend``: structured outputs with xgrammar (JSON schema, regex, choice, EBNF/GBNF grammars).

xgrammar compiles a grammar ahead of time into per-state token masks (its ``GrammarCompiler`` caches them),
so a first compile costs more and each step's mask less. It imports torch, so it does not validate in the API
front end: a constraint that cannot compile fails its request in the engine, with xgrammar's message (a 400
for a request that does not stream).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar

if TYPE_CHECKING:
    import torch
    import xgrammar

    from tokenmill.tokenizer import Tokenizer


class XgrammarGrammar(StructuredOutputGrammar):
    """One request's ``xgrammar.GrammarMatcher``; it counts its tokens so that ``rollback`` can undo them."""

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for position, token_id in enumerate(token_ids):
            if not self.matcher.accept_token(token_id):
                self.matcher.rollback(position)
                return False
        return True

    def validate_tokens(self, token_ids: list[int]) -> int:
        num_valid = 0
        for token_id in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                break
            num_valid += 1
        if num_valid:
            self.matcher.rollback(num_valid)
        return num_valid

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XgrammarBackend(StructuredOutputBackend):
    """xgrammar over the model's tokenizer (its vocabulary read once, as xgrammar's ``TokenizerInfo``)."""

    name: ClassVar[str] = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        import xgrammar  # imports torch: here, not when the API front end loads this class to see it validates nothing
        from transformers import PreTrainedTokenizerFast  # xgrammar's own dependency

        hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=max(vocab_size, tokenizer.vocab_size), stop_token_ids=list(tokenizer.eos_token_ids)
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)

    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                schema: Any = {"type": "object"} if params.json_object else params.json
                compact = params.disable_any_whitespace
                return self.compiler.compile_json_schema(
                    schema if isinstance(schema, str) else json.dumps(schema),
                    any_whitespace=not compact,
                    # Without whitespace, xgrammar still writes ": " and ", " unless given the separators.
                    separators=(",", ":") if compact else None,
                )
            if kind == "regex":
                assert params.regex is not None
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                assert params.choice is not None
                alternatives = " | ".join(json.dumps(choice) for choice in params.choice)
                return self.compiler.compile_grammar(f"root ::= {alternatives}")
            assert params.grammar is not None
            return self.compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            raise ValueError(" ".join(lines[:3]) or type(exc).__name__) from None

    def grammar(self, compiled: Any) -> StructuredOutputGrammar:
        import xgrammar

        return XgrammarGrammar(xgrammar.GrammarMatcher(compiled))
