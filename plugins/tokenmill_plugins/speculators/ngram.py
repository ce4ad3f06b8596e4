"""``ngram``: prompt lookup decoding. Drafts what followed the latest earlier occurrence of the request's
last few tokens, in its own prompt and output.

Summaries, rewrites, code edits and RAG answers copy long runs of their input;
where the request's last ``n`` tokens appeared before, the tokens that followed
them then are a good guess for what follows now, and guessing costs no model.
``n`` runs from ``prompt_lookup_max`` down to ``prompt_lookup_min``: the
longest match is tried first, and the most recent occurrence of it wins.
Drafts are deterministic (the core verifies them with ``q`` one-hot).
"""

from __future__ import annotations

from typing import ClassVar

import numpy
from numpy.lib.stride_tricks import sliding_window_view

from tokenmill.speculator import Proposal, SpeculationInput, Speculator, SpeculatorContext

# Measured on the copy workload (docs/benchmarks.md): a 1- or 2-token match is often a coincidence (acceptance
# 0.49 and 0.64 from n >= 1 and n >= 2), a 3-token one rarely (0.77).
DEFAULT_PROMPT_LOOKUP_MIN = 3
DEFAULT_PROMPT_LOOKUP_MAX = 5


class NgramSpeculator(Speculator):
    """Prompt lookup; ``speculative_config.prompt_lookup_min``/``prompt_lookup_max`` bound the n-gram."""

    name: ClassVar[str] = "ngram"
    default_num_speculative_tokens: ClassVar[int] = 8  # the draft policy trims it to what pays

    def __init__(self, num_speculative_tokens: int, context: SpeculatorContext | None = None) -> None:
        super().__init__(num_speculative_tokens, context)
        spec = context.config.speculative_config if context is not None else None
        self.prompt_lookup_min = (spec and spec.prompt_lookup_min) or DEFAULT_PROMPT_LOOKUP_MIN
        self.prompt_lookup_max = (spec and spec.prompt_lookup_max) or max(
            DEFAULT_PROMPT_LOOKUP_MAX, self.prompt_lookup_min
        )

    def propose(self, requests: list[SpeculationInput]) -> Proposal:
        return Proposal([self._lookup(request) for request in requests])

    def _lookup(self, request: SpeculationInput) -> list[int]:
        limit = min(self.num_speculative_tokens, request.max_num_tokens)
        if limit <= 0:
            return []
        tokens = numpy.asarray(request.token_ids, dtype=numpy.int64)
        for n in range(min(self.prompt_lookup_max, len(tokens) - 1), self.prompt_lookup_min - 1, -1):
            # Every earlier window of n tokens against the last n: one vectorised comparison.
            windows = sliding_window_view(tokens[:-1], n)  # [len - n, n]
            matches = numpy.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n  # the token after the latest earlier occurrence
                return tokens[start : start + limit].tolist()
        return []
