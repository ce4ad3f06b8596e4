"""Seeded workloads: Poisson arrivals, log-normal mixed lengths, random prompts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tokenmill_plugins.commands.bench.workload import (
    MAX_TOKEN_ID,
    MIN_TOKEN_ID,
    arrival_times,
    random_texts,
    random_token_ids,
    sample_lengths,
    shared_prefix_prompts,
)


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate() -> None:
    times = arrival_times(20_000, 50.0, seed=1)
    assert times == arrival_times(20_000, 50.0, seed=1)
    assert times != arrival_times(20_000, 50.0, seed=2)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean (a fixed interval would give 0).
    assert gaps.std() == pytest.approx(1 / 50, rel=0.05)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(5, math.inf, seed=0) == [0.0] * 5
    with pytest.raises(ValueError, match="request_rate"):
        arrival_times(5, 0.0, seed=0)


def test_fixed_lengths_are_exact() -> None:
    assert sample_lengths(4, 128, seed=0, mixed=False) == [128] * 4


def test_mixed_lengths_are_seeded_bounded_and_centred() -> None:
    lengths = sample_lengths(5000, 200, seed=7, mixed=True)
    assert lengths == sample_lengths(5000, 200, seed=7, mixed=True)
    assert lengths != sample_lengths(5000, 200, seed=8, mixed=True)
    assert min(lengths) >= 50 and max(lengths) <= 800
    assert len(set(lengths)) > 100
    assert np.mean(lengths) == pytest.approx(200, rel=0.03)
    # Prompt and output lengths from the same seed are independent draws.
    assert sample_lengths(50, 200, seed=7, mixed=True, stream=1) != lengths[:50]
    # A mean of 1 cannot go below 1.
    assert set(sample_lengths(100, 1, seed=0, mixed=True)) <= {1, 2, 3, 4}


def test_random_token_ids_have_exact_lengths_and_avoid_special_ids() -> None:
    prompts = random_token_ids([3, 17, 256], seed=0)
    assert [len(p) for p in prompts] == [3, 17, 256]
    assert all(MIN_TOKEN_ID <= t < MAX_TOKEN_ID for p in prompts for t in p)
    assert prompts == random_token_ids([3, 17, 256], seed=0)
    assert all(t < 5000 for t in random_token_ids([500], seed=0, vocab_size=5000)[0])


def test_random_texts_have_the_word_count() -> None:
    texts = random_texts([5, 40], seed=3)
    assert [len(t.split()) for t in texts] == [5, 40]
    assert texts == random_texts([5, 40], seed=3)


def test_shared_prefix_prompts_share_exactly_the_prefix() -> None:
    prompts = shared_prefix_prompts(20, 50, (3, 6), seed=4)
    assert prompts == shared_prefix_prompts(20, 50, (3, 6), seed=4)
    assert prompts != shared_prefix_prompts(20, 50, (3, 6), seed=5)
    prefix = prompts[0][:50]
    assert all(p[:50] == prefix and 53 <= len(p) <= 56 for p in prompts)
    assert {len(p) for p in prompts} == {53, 54, 55, 56}  # both ends of the range are drawn
    assert len({tuple(p[50:]) for p in prompts}) == 20  # distinct questions
    assert all(MIN_TOKEN_ID <= t < MAX_TOKEN_ID for p in prompts for t in p)
    with pytest.raises(ValueError):
        shared_prefix_prompts(2, 10, (5, 4), seed=0)
