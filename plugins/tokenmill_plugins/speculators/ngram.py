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

from collections.abc import Sequence
from typing import ClassVar

from tokenmill.speculative.speculator import Proposal, SpeculationInput, Speculator, SpeculatorContext

# A 1- or 2-token match is often a coincidence, a 3-token one rarely.
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
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: list[SpeculationInput]) -> Proposal:
        return Proposal([self._lookup(request) for request in requests])

    def on_requests_finished(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._indexes.pop(request_id, None)

    def _lookup(self, request: SpeculationInput) -> list[int]:
        limit = min(self.num_speculative_tokens, request.max_num_tokens)
        if limit <= 0:
            return []
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = NgramIndex(self.prompt_lookup_min, self.prompt_lookup_max)
        return index.continuation(request.token_ids, limit)


class NgramIndex:
    """Where each n-gram of one request's tokens last occurred, for ``n`` from ``min_n`` to ``max_n``, brought
    up to date with the tokens that arrived since the last lookup. A lookup then costs a few dictionary reads
    where scanning every window costs a pass over the request per ``n``. A request's tokens only grow (a request
    that is preempted is forgotten and indexed again); one that changed anyway is indexed again."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        #: n-gram -> the start of its latest occurrence among the windows that end before the last token (the
        #: last n tokens themselves are what is looked up, so they must not match themselves).
        self._starts: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # windows ending at positions below this one are in ``_starts``

    def continuation(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest matching suffix
        of ``tokens`` (``max_n`` down to ``min_n`` tokens); empty when none occurred before."""
        length = len(tokens)
        if length < self._indexed:
            self._starts.clear()
            self._indexed = 0
        self._extend(tokens, length - 1)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tuple(tokens[length - n :])
            start = self._starts.get(suffix)
            if start is not None:
                if tuple(tokens[start : start + n]) != suffix:  # the tokens changed under the index
                    self._starts.clear()
                    self._indexed = 0
                    return self.continuation(tokens, limit)
                return list(tokens[start + n : start + n + limit])
        return []

    def _extend(self, tokens: Sequence[int], end: int) -> None:
        """Index every window that ends (exclusive) at a position in ``[self._indexed, end]``."""
        starts = self._starts
        for stop in range(max(self._indexed, self.min_n), end + 1):
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                starts[tuple(tokens[stop - n : stop])] = stop - n
        self._indexed = max(self._indexed, end + 1)
