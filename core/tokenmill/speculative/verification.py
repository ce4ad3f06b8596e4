"""Verifying a step's drafts: each request keeps its accepted drafts plus one token of the target's.

The executor calls ``verify_drafts`` for a step in which any request verifies drafts, with the logits of every
sampling row and of each draft's position. Each draft position is a sampling row of its own whose token
history includes the drafts before it, so penalties and logits processors see exactly what plain decoding
would, and a constrained request's rows are masked to what its grammar allows there. All-greedy steps compare
the sampler's greedy tokens (``verify_greedy``); any other step draws by rejection sampling
(``rejection_sample``): accepted tokens have exactly the target's distribution.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.request import Request
from tokenmill.sampling.logits_processor import LogitsProcessor, SamplingRow
from tokenmill.sampling.logprobs import verified_logprobs
from tokenmill.sampling.sampler import Sampler, SamplingMetadata
from tokenmill.scheduler import ModelRunnerOutput, SchedulerOutput
from tokenmill.speculative.draft_tree import path
from tokenmill.speculative.proposer import Proposer
from tokenmill.speculative.rejection_sampler import rejection_sample, verify_greedy
from tokenmill.structured_output.bitmask import mask_draft_logits


def verify_drafts(
    scheduler_output: SchedulerOutput,
    logits: torch.Tensor,
    hidden: torch.Tensor | None,
    first_row: dict[int, int],
    sampler: Sampler,
    logits_processors: list[LogitsProcessor],
    generator: Callable[[Request], torch.Generator | None],
    proposer: Proposer,
) -> ModelRunnerOutput:
    """Every sampling request's tokens for a step with drafts.

    :param logits: [num_rows, vocab] float32: of each scheduled request that samples, its last token's row
        then one row per draft; ``first_row`` maps a scheduled index to its first row.
    :param hidden: the same rows' final hidden states, when the speculator reads them.
    :param generator: the request's own generator (seeded requests), else None.
    """
    requests: list[Request] = []
    drafts: list[tuple[int, ...]] = []
    parents: list[tuple[int, ...] | None] = []
    row_index: list[int] = []  # logits rows, in verification order
    rows: list[SamplingRow] = []
    for index, request in scheduler_output.sampling_requests:
        scheduled = scheduler_output.scheduled[index]
        is_own = request is scheduled.request  # a fork has no drafts
        own = scheduled.draft_token_ids if is_own else ()
        tree = scheduled.draft_parents if is_own else None
        requests.append(request)
        drafts.append(own)
        parents.append(tree)
        row_index.extend(range(first_row[index], first_row[index] + len(own) + 1))
        history = request.output_token_ids
        for j in range(len(own) + 1):
            # Row j follows draft j - 1: its history holds the drafts on the way there (of a tree, its path).
            before = own[:j] if tree is None else [own[node] for node in path(tree, j - 1)]
            seen = [*history, *before] if j else history
            rows.append(SamplingRow(request.request_id, request.params, request.prompt_token_ids, seen,
                                    request.eos_token_ids))  # fmt: skip
    index_tensor = torch.tensor(row_index, device=logits.device)
    logits = logits[index_tensor]
    # Structured outputs: every row masked to what the request's grammar allows after the drafts before it, so a
    # draft that breaks the grammar has probability zero there and is rejected.
    logits = mask_draft_logits(logits, requests, drafts, parents)
    metadata = SamplingMetadata.from_requests(
        rows, generators=[None] * len(rows), vocab_size=logits.shape[-1], device=logits.device,
        logits_processors=logits_processors,
    )  # fmt: skip
    draft_probs = [proposer.take_draft_probs(r.request_id, len(own)) for r, own in zip(requests, drafts, strict=True)]
    greedy = [request.params.is_greedy for request in requests]
    if all(greedy):
        # The sampler's own greedy tokens decide, without building one-hot distributions over the vocabulary.
        verified = verify_greedy(sampler(logits, metadata).token_ids.tolist(), drafts, parents)
    else:
        probs = sampler.target_probs(logits, metadata)
        generators = [generator(request) for request in requests]
        verified = rejection_sample(probs, drafts, draft_probs, greedy, generators, parents)

    wants_logprobs = any(request.params.logprobs is not None for request in requests)
    raw_logprobs = logits.log_softmax(dim=-1) if wants_logprobs else None
    hidden_rows = hidden[index_tensor] if hidden is not None else None
    policy = proposer.draft_policy
    output = ModelRunnerOutput()
    start = 0
    for request, own, tree, result in zip(requests, drafts, parents, verified, strict=True):
        request_id = request.request_id
        failed = [metadata.errors[row] for row in range(start, start + len(own) + 1) if row in metadata.errors]
        if failed:
            output.errors[request_id] = failed[0]
        else:
            output.sampled_token_ids[request_id] = result.token_ids
            if own:
                output.accepted_drafts[request_id] = list(result.nodes)
            # The rows that gave the tokens: the root's, then each accepted draft's.
            token_rows = [start, *(start + node + 1 for node in result.nodes)]
            if raw_logprobs is not None and request.params.logprobs is not None:
                output.logprobs[request_id] = verified_logprobs(
                    raw_logprobs[token_rows], result.token_ids, request.params.logprobs
                )
            if hidden_rows is not None:
                output.hidden_states[request_id] = hidden_rows[token_rows[-1]]
            if own and policy is not None:
                policy.observe_verification(request_id, len(own), result.num_accepted,
                                            result.nodes if tree is not None else None)  # fmt: skip
        start += len(own) + 1
    return output
