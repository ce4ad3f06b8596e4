"""``banned-words``: token ids that cannot be generated, globally (options) and per request (``vllm_xargs``)."""

from __future__ import annotations

from typing import ClassVar

import torch

from tokenmill import LogitsProcessor, SamplingRow
from tokenmill_example_policies.options import ExamplePoliciesOptions

#: The ``SamplingParams.extra_args`` key (``vllm_xargs`` over HTTP) a request bans its own tokens with.
EXTRA_ARGS_KEY = "banned_token_ids"


def request_banned_ids(row: SamplingRow) -> list[int]:
    """The ids a request bans itself; a malformed value fails that request with this message."""
    value = (row.params.extra_args or {}).get(EXTRA_ARGS_KEY, [])
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"vllm_xargs[{EXTRA_ARGS_KEY!r}] must be a list of token ids, got {value!r}")
    return value


class BannedWordsLogitsProcessor(LogitsProcessor):
    """Sets the logits of banned token ids to -inf, so they are never sampled."""

    name: ClassVar[str] = "banned-words"

    def __init__(self, options: ExamplePoliciesOptions | None = None) -> None:
        self.banned_token_ids = list((options or ExamplePoliciesOptions()).banned_token_ids)

    def is_active(self, row: SamplingRow) -> bool:
        return bool(self.banned_token_ids) or bool(request_banned_ids(row))

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[SamplingRow]) -> torch.Tensor:
        vocab_size = logits.shape[1]
        row_index: list[int] = []
        token_ids: list[int] = []
        for row, state in zip(rows, states, strict=True):
            banned = {t for t in (*self.banned_token_ids, *request_banned_ids(state)) if 0 <= t < vocab_size}
            if len(banned) == vocab_size:
                raise ValueError(f"request {state.request_id!r} bans every token id: nothing could be sampled")
            row_index += [row] * len(banned)
            token_ids += sorted(banned)
        # One indexed write for the whole batch.
        index = (torch.tensor(row_index, device=logits.device), torch.tensor(token_ids, device=logits.device))
        return logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))
