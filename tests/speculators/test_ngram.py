"""Prompt lookup (``ngram``): its incremental n-gram index drafts what a scan of every window drafts."""

from __future__ import annotations

import random

from tokenmill_plugins.speculators.ngram import NgramIndex, NgramSpeculator

from tokenmill.speculative.speculator import SpeculationInput


def _scan(tokens: list[int], min_n: int, max_n: int, limit: int) -> list[int]:
    """The definition: the latest earlier window equal to the last ``n`` tokens, longest ``n`` first."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - 1 - n, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + limit]
    return []


def test_the_index_drafts_what_a_scan_of_every_window_drafts() -> None:
    rng = random.Random(0)
    for trial in range(40):
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        index = NgramIndex(min_n, max_n)
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]  # few symbols: many repeats
        for _ in range(40):
            limit = rng.randrange(1, 9)
            assert index.continuation(tokens, limit) == _scan(tokens, min_n, max_n, limit), (trial, tokens)
            tokens += [rng.randrange(4) for _ in range(rng.randrange(1, 5))]  # a step's accepted tokens


def test_tokens_that_changed_under_the_index_are_indexed_again() -> None:
    index = NgramIndex(2, 3)
    assert index.continuation([1, 2, 3, 1, 2], 4) == [3, 1, 2]
    assert index.continuation([7, 8, 9, 7, 8, 5, 7, 8], 4) == [5, 7, 8]  # same request id, other tokens
    changed = [9] * 8 + [7, 8]  # longer than what was indexed, but (7, 8) was indexed at 3, which is now (9, 9)
    assert index.continuation(changed, 4) == [] == _scan(changed, 2, 3, 4)
    assert index.continuation([4, 4, 4], 4) == [4]  # shorter than what was indexed


def test_the_speculator_forgets_a_finished_request() -> None:
    speculator = NgramSpeculator(4)
    request = SpeculationInput("r", [5, 6, 7, 8, 5, 6, 7], num_prompt_tokens=7, max_num_tokens=4)
    assert speculator.propose([request]).token_ids == [[8, 5, 6, 7]]
    assert "r" in speculator._indexes
    speculator.on_requests_finished(["r"])
    assert "r" not in speculator._indexes
