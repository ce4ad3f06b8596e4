"""``NumberDigitCap``: at most N digits in a row in a JSON number, over any backend's grammar.

JSON and JSON Schema put no bound on a number's digits, and neither llguidance nor xgrammar has a setting for
one, so a model that starts a number may write digits until ``max_tokens`` and leave its reply cut, invalid
JSON (a small model at temperature 1.0 does: docs/benchmarks.md, "Structured outputs"). llama.cpp's JSON grammars
bound a number's parts to 16 digits each. This wrapper bounds each run of digits outside strings (a number's
integer part, fraction and exponent) to ``structured_outputs_config.max_number_digits``: once a run is that long,
tokens that start with a digit leave the mask, unless the grammar allows nothing else. It only takes tokens
away from what the grammar allows, so every output still matches the grammar. Imports torch only to mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.structured_output.backend import StructuredOutputGrammar

if TYPE_CHECKING:
    import torch

    from tokenmill.tokenizer import Tokenizer

#: Where the JSON text is after some tokens: inside a string, just after a backslash there, and how many digits
#: in a row end it (outside strings).
State = tuple[bool, bool, int]
START: State = (False, False, 0)


def advance(state: State, text: str) -> State:
    """The state after ``text``."""
    in_string, escaped, digits = state
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string, digits = True, 0
        elif "0" <= char <= "9":
            digits += 1
        else:
            digits = 0
    return in_string, escaped, digits


class TokenTexts:
    """Each token's text, and a bitmask row of the tokens whose text starts with a digit; built once per backend
    (a batch decode of the vocabulary: about 30 ms for 49k tokens)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import numpy as np
        import torch

        ids = [[token_id] for token_id in range(tokenizer.vocab_size)]
        self.texts: list[str] = tokenizer.backend.decode_batch(ids, skip_special_tokens=False)
        digit_start = np.zeros((max(vocab_size, len(self.texts)) + 31) // 32 * 32, dtype=bool)
        digit_start[[i for i, text in enumerate(self.texts) if "0" <= text[:1] <= "9"]] = True
        words = np.packbits(digit_start, bitorder="little").view("<i4")
        #: The bitmask's layout (int32 words, bit ``t % 32`` of word ``t // 32``): the tokens that start with a digit.
        self.digit_start = torch.from_numpy(words.astype(np.int32))

    def text(self, token_id: int) -> str:
        return self.texts[token_id] if token_id < len(self.texts) else ""


class NumberDigitCap(StructuredOutputGrammar):
    """``grammar`` (a JSON constraint's matcher) with at most ``max_digits`` digits in a row outside strings."""

    def __init__(self, grammar: StructuredOutputGrammar, tokens: TokenTexts, max_digits: int) -> None:
        self.grammar = grammar
        self.tokens = tokens
        self.max_digits = max_digits
        self.state = START
        self._states: list[State] = []  # the state before each accepted token, for ``rollback``

    def _capped(self, state: State) -> bool:
        return not state[0] and state[2] >= self.max_digits

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if not self.grammar.accept_tokens(token_ids):
            return False
        for token_id in token_ids:
            self._states.append(self.state)
            self.state = advance(self.state, self.tokens.text(token_id))
        return True

    def validate_tokens(self, token_ids: list[int]) -> int:
        num_valid = self.grammar.validate_tokens(token_ids)
        state = self.state
        for position, token_id in enumerate(token_ids[:num_valid]):
            text = self.tokens.text(token_id)
            if self._capped(state) and "0" <= text[:1] <= "9":
                return position
            state = advance(state, text)
        return num_valid

    def rollback(self, num_tokens: int) -> None:
        self.grammar.rollback(num_tokens)
        if num_tokens:
            self.state = self._states[-num_tokens]
            del self._states[-num_tokens:]

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.grammar.fill_bitmask(bitmask, index)
        if self._capped(self.state):
            row = bitmask[index]
            kept = row & ~self.tokens.digit_start[: row.numel()]
            if bool(kept.any()):
                row.copy_(kept)

    def is_terminated(self) -> bool:
        return self.grammar.is_terminated()
