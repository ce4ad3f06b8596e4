"""Logprobs as the API reports them: tensors of one step turned into ``TokenLogprobs``, once per step.

Always of the model's raw distribution (before penalties, logits processors and temperature), as OpenAI and
vLLM report them. Called by the executor in the engine process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.messages import TokenLogprobs
from tokenmill.request import Request
from tokenmill.sampling.sampler import SamplerOutput


def sampled_logprobs(
    sampled: SamplerOutput, token_ids: list[int], requests: Sequence[Request]
) -> list[TokenLogprobs | None]:
    """Each sampling row's logprobs, as its request asked (None when it did not); tensors are turned into
    Python once per step, not per row."""
    if sampled.logprobs is None:
        return [None] * len(requests)
    logprobs = sampled.logprobs.tolist()
    top_ids = sampled.top_token_ids.tolist() if sampled.top_token_ids is not None else None
    top_values = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
    rows: list[TokenLogprobs | None] = []
    for row, request in enumerate(requests):
        wanted = request.params.logprobs
        if wanted is None:
            rows.append(None)
            continue
        rows.append(TokenLogprobs(
            token_id=token_ids[row],
            logprob=logprobs[row],
            top_token_ids=tuple(top_ids[row][:wanted]) if top_ids is not None else (),
            top_logprobs=tuple(top_values[row][:wanted]) if top_values is not None else (),
        ))  # fmt: skip
    return rows


def verified_logprobs(raw_logprobs: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """The target's logprobs of each verified token [len(token_ids), vocab] -> one ``TokenLogprobs`` each."""
    index = torch.tensor(token_ids, device=raw_logprobs.device)
    chosen = raw_logprobs[torch.arange(len(token_ids), device=raw_logprobs.device), index].tolist()
    top_values, top_ids = raw_logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    tops = (
        zip(top_ids.tolist(), top_values.tolist(), strict=True)
        if top_ids is not None and top_values is not None
        else [((), ())] * len(token_ids)
    )
    return [
        TokenLogprobs(token_id=token, logprob=value, top_token_ids=tuple(ids), top_logprobs=tuple(values))
        for token, value, (ids, values) in zip(token_ids, chosen, tops, strict=True)
    ]


def prompt_logprobs(logits: torch.Tensor, rows: list[tuple[Request, int, int]]) -> dict[str, list[TokenLogprobs]]:
    """Each request's prompt tokens scored by the positions before them: ``rows`` holds (request, first
    position, number of rows) in the order of ``logits``' rows; position p scores prompt token p + 1. Gives
    logprob, rank and the top alternatives."""
    raw = logits.log_softmax(dim=-1)
    targets: list[int] = []
    for request, first, count in rows:
        targets += request.prompt_token_ids[first + 1 : first + 1 + count]
    index = torch.tensor(targets, device=raw.device)
    chosen = raw[torch.arange(len(targets), device=raw.device), index]
    ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
    num_top = max(request.params.prompt_logprobs or 0 for request, _, _ in rows)
    top_values, top_ids = raw.topk(num_top, dim=-1) if num_top else (None, None)
    chosen_list, rank_list = chosen.tolist(), ranks.tolist()
    values = top_values.tolist() if top_values is not None else None
    ids = top_ids.tolist() if top_ids is not None else None
    result: dict[str, list[TokenLogprobs]] = {}
    row = 0
    for request, _, count in rows:
        wanted = request.params.prompt_logprobs or 0
        result[request.request_id] = [
            TokenLogprobs(
                token_id=targets[r], logprob=chosen_list[r],
                top_token_ids=tuple(ids[r][:wanted]) if ids is not None else (),
                top_logprobs=tuple(values[r][:wanted]) if values is not None else (), rank=rank_list[r],
            )
            for r in range(row, row + count)
        ]  # fmt: skip
        row += count
    return result
