"""The shape of a benchmark's load: prompt and output lengths, prompt contents and arrival times.

Everything is drawn from ``numpy.random.Generator`` streams derived from one
seed, one stream per purpose, so changing the request rate does not change the
prompts and two runs with the same flags send the same requests.
"""

from __future__ import annotations

import logging
import math

import numpy as np

logger = logging.getLogger(__name__)

#: Random prompt token ids are drawn from [MIN_TOKEN_ID, MAX_TOKEN_ID): past the
#: special tokens that tokenizers put at the start of their vocabularies, and
#: inside the vocabulary of any model worth benchmarking.
MIN_TOKEN_ID = 1000
MAX_TOKEN_ID = 20000

#: Spread of the log-normal lengths of ``--mixed``, as the sigma of the underlying normal.
MIXED_SIGMA = 0.5
#: ``--mixed`` lengths are clipped to [mean / MIXED_SPREAD, mean * MIXED_SPREAD].
MIXED_SPREAD = 4

# Short English words that BPE tokenizers keep as one token with their leading
# space, so a chat prompt of n words is close to n tokens.
_WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by not but what some we "
    "can out other were all there when up use your how said an each she which do their time if will way about many "
    "then them write would like so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now find any new work part take "
    "get place made live where after back little only round man year came show every good me give our under name"
).split()


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed, *keys])


# Stream numbers: one per purpose, so each draw is independent of the others.
_LENGTHS, _PROMPTS, _ARRIVALS, _SHARED_PREFIX, _TENANTS = 0, 1, 2, 3, 4


def sample_lengths(
    num: int, mean: int, *, seed: int, mixed: bool, sigma: float = MIXED_SIGMA, stream: int = 0
) -> list[int]:
    """``num`` lengths: all ``mean``, or with ``mixed`` log-normal with that mean.

    Mixed lengths are clipped to ``[max(1, mean // MIXED_SPREAD), mean * MIXED_SPREAD]``,
    so one unlucky draw cannot blow a context window. ``stream`` tells apart
    the draws for prompts and outputs made with the same seed.
    """
    if mean < 1:
        raise ValueError(f"a length must be at least 1, got {mean}")
    if not mixed:
        return [mean] * num
    # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2); choose mu so the mean is `mean`.
    mu = math.log(mean) - sigma**2 / 2
    draws = _rng(seed, _LENGTHS, stream).lognormal(mu, sigma, size=num)
    low, high = max(1, mean // MIXED_SPREAD), mean * MIXED_SPREAD
    return [int(n) for n in np.clip(np.rint(draws), low, high)]


def random_token_ids(lengths: list[int], *, seed: int, vocab_size: int | None = None) -> list[list[int]]:
    """One list of random token ids per length, drawn from [MIN_TOKEN_ID, MAX_TOKEN_ID)
    (capped at ``vocab_size`` when it is known and smaller)."""
    high = MAX_TOKEN_ID if vocab_size is None else min(MAX_TOKEN_ID, vocab_size)
    low = min(MIN_TOKEN_ID, high // 2)
    rng = _rng(seed, _PROMPTS)
    return [rng.integers(low, high, size=n).tolist() for n in lengths]


def shared_prefix_prompts(
    num: int, prefix_len: int, question_lens: tuple[int, int], *, seed: int, vocab_size: int | None = None
) -> list[list[int]]:
    """``num`` token-id prompts that share one random ``prefix_len``-token prefix (a "system prompt")
    and each end in a distinct random "question" of a length drawn uniformly from ``question_lens``
    (inclusive). The same arguments give the same prompts."""
    low_len, high_len = question_lens
    if prefix_len < 1 or not 1 <= low_len <= high_len:
        raise ValueError(f"need prefix_len >= 1 and 1 <= question lengths {question_lens}, got {prefix_len}")
    rng = _rng(seed, _SHARED_PREFIX)
    lengths = rng.integers(low_len, high_len + 1, size=num).tolist()
    high = MAX_TOKEN_ID if vocab_size is None else min(MAX_TOKEN_ID, vocab_size)
    low = min(MIN_TOKEN_ID, high // 2)
    prefix = rng.integers(low, high, size=prefix_len).tolist()
    return [prefix + rng.integers(low, high, size=n).tolist() for n in lengths]


def multi_tenant_prompts(
    num: int,
    num_tenants: int,
    system_prompt_len: int,
    suffix_lens: tuple[int, int],
    *,
    seed: int,
    vocab_size: int | None = None,
) -> tuple[list[list[int]], list[int]]:
    """A shared-prefix multi-tenant workload: ``num_tenants`` tenants, each with its own random
    ``system_prompt_len``-token system prompt, and ``num`` requests, each its tenant's system prompt then a
    distinct random user suffix of a length drawn uniformly from ``suffix_lens`` (inclusive). Tenants are
    interleaved: each request's tenant is drawn uniformly, so consecutive requests rarely share a prefix.
    Returns ``(prompts, tenant of each prompt)``; the same arguments give the same workload."""
    low_len, high_len = suffix_lens
    if num_tenants < 1 or system_prompt_len < 1 or not 1 <= low_len <= high_len:
        raise ValueError(f"need num_tenants >= 1, system_prompt_len >= 1 and 1 <= suffix lengths {suffix_lens}, "
                         f"got {num_tenants} and {system_prompt_len}")  # fmt: skip
    rng = _rng(seed, _TENANTS)
    high = MAX_TOKEN_ID if vocab_size is None else min(MAX_TOKEN_ID, vocab_size)
    low = min(MIN_TOKEN_ID, high // 2)
    system_prompts = [rng.integers(low, high, size=system_prompt_len).tolist() for _ in range(num_tenants)]
    tenants = rng.integers(0, num_tenants, size=num).tolist()
    lengths = rng.integers(low_len, high_len + 1, size=num).tolist()
    prompts = [
        system_prompts[t] + rng.integers(low, high, size=n).tolist() for t, n in zip(tenants, lengths, strict=True)
    ]
    return prompts, tenants


def random_texts(lengths: list[int], *, seed: int) -> list[str]:
    """One text of ``n`` random common words per length: about ``n`` tokens in most
    tokenizers, for APIs that take no token ids (chat)."""
    rng = _rng(seed, _PROMPTS)
    return [" ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=n)) for n in lengths]


def arrival_times(num: int, request_rate: float, *, seed: int) -> list[float]:
    """When each request is sent, in seconds after the start: a Poisson process.

    Gaps between arrivals are exponential with mean ``1 / request_rate``; the first
    request goes at 0. An infinite rate sends everything at once.
    """
    if request_rate <= 0:
        raise ValueError(f"request_rate must be positive (or inf), got {request_rate}")
    if math.isinf(request_rate) or num == 0:
        return [0.0] * num
    gaps = _rng(seed, _ARRIVALS).exponential(1.0 / request_rate, size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
