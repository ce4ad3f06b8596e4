"""``max_number_digits``: a JSON number's runs of digits end, whatever the model prefers, and nothing else changes.

A model pushed towards digits (``logit_bias`` +100 on every digit token) writes a number until ``max_tokens``
without the cap (the planted case: ``max_number_digits`` 0), and a complete, valid reply with it, on both backends;
digits inside strings are not counted, and drafts past the cap are trimmed and rolled back exactly.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tokenmill_plugins.structured_outputs.guidance import GuidanceBackend

from tests.factories import make_engine
from tests.structured_output.schemas import assert_valid
from tests.structured_output.test_engine import _run
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured_output.bitmask import allocate_token_bitmask
from tokenmill.structured_output.number_digits import START, NumberDigitCap, TokenTexts, advance
from tokenmill.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "s": {"type": "string", "maxLength": 12}},
    "required": ["x", "s"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_path(model_dir)


def _digit_ids(tokenizer: Tokenizer) -> list[int]:
    return [t for t in range(tokenizer.vocab_size) if re.fullmatch(r"[0-9]+", tokenizer.decode([t]))]


def test_the_state_counts_digits_outside_strings_only() -> None:
    assert advance(START, '{"a": 12') == (False, False, 2)
    assert advance(START, '{"a": "1234') == (True, False, 0)
    assert advance(START, '{"a": "12\\"34", "b": 5') == (False, False, 1)  # an escaped quote does not end it
    assert advance(START, '{"a": "x\\\\"') == (False, False, 0)  # an escaped backslash does not escape the quote
    assert advance(START, '{"a": 1.25e7') == (False, False, 1)


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_a_number_ends_at_the_cap_and_the_reply_completes(model_dir: Path, tokenizer: Tokenizer, backend: str) -> None:
    bias = dict.fromkeys(_digit_ids(tokenizer), 100.0)
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=80, logit_bias=bias, structured_outputs=constraint)
        for seed in range(4)
    ]
    config = {"backend": backend, "max_number_digits": 6}
    capped = _run(make_engine(model_dir, structured_outputs_config=config), tokenizer, params)
    for result in capped.values():
        text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        assert result.error is None and result.finish_reason == "stop", text
        assert_valid(text, SCHEMA, backend)
        number = text[len('{"x":') : text.index(',"s":')]
        assert max(len(run) for run in re.findall(r"[0-9]+", number)) == 6, text
    # The planted case: without the cap the same requests write digits until max_tokens.
    uncapped_engine = make_engine(model_dir, structured_outputs_config={**config, "max_number_digits": 0})
    uncapped = _run(uncapped_engine, tokenizer, params)
    assert all(result.finish_reason == "length" for result in uncapped.values())


def test_drafts_past_the_cap_are_trimmed_and_rollback_restores_the_state(tokenizer: Tokenizer) -> None:
    backend = GuidanceBackend(tokenizer, tokenizer.vocab_size)
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    tokens = TokenTexts(tokenizer, tokenizer.vocab_size)
    grammar = NumberDigitCap(backend.grammar(backend.compile_grammar(constraint)), tokens, 3)
    digits = _digit_ids(tokenizer)
    one, two = tokenizer.encode("1", add_special_tokens=False), tokenizer.encode("2", add_special_tokens=False)
    assert grammar.accept_tokens(tokenizer.encode('{"x":12', add_special_tokens=False))

    def allowed() -> set[int]:
        bitmask = allocate_token_bitmask(1, tokenizer.vocab_size, torch.device("cpu"))
        grammar.fill_bitmask(bitmask, 0)
        words = bitmask[0].tolist()
        return {t for t in range(tokenizer.vocab_size) if words[t // 32] >> (t % 32) & 1}

    assert set(digits) <= allowed()
    assert grammar.validate_tokens(one + two) == 1  # the third digit fits, the fourth does not
    assert grammar.accept_tokens(one)
    assert not set(digits) & allowed() and allowed()  # digits gone, '.', 'e' and ',' left
    grammar.rollback(1)
    assert set(digits) <= allowed()
    # Inside a string, digits are not counted.
    assert grammar.accept_tokens(tokenizer.encode('1,"s":"1234', add_special_tokens=False))
    assert set(digits) & allowed()
