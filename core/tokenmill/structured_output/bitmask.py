"""Token bitmasks of one step: filled on the host by each constrained request's matcher, applied on the device.

The executor calls ``fill_bitmask`` for the sampling rows of constrained requests (their drafts' positions
too, when verifying), then ``apply_token_bitmask`` to the logits before sampling, so the sampler, its
logprobs and speculative verification all see the masked distribution (as vLLM does). Only the bitmask,
``ceil(vocab_size / 32)`` int32 words per constrained row, is copied to the device; the mask is unpacked and
applied there with torch ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.device_copy import to_device
from tokenmill.request import Request
from tokenmill.speculative.draft_tree import path
from tokenmill.structured_output.backend import StructuredOutputGrammar


def allocate_token_bitmask(num_rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """A host bitmask of ``num_rows`` rows with every token allowed; pinned when the logits are on a GPU, so its
    copy there does not wait."""
    shape = (num_rows, (vocab_size + 31) // 32)
    pin = device.type == "cuda"
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)  # [num_rows, ceil(vocab_size / 32)]


def fill_draft_bitmask(
    grammar: StructuredOutputGrammar,
    draft_token_ids: Sequence[int],
    draft_parents: Sequence[int] | None,
    bitmask: torch.Tensor,
    first_row: int,
) -> None:
    """Fill the ``len(draft_token_ids) + 1`` rows of one request that verifies drafts: row 0 with what the
    grammar allows now, row ``j + 1`` with what it allows after draft ``j`` (after its path, for a tree), and
    leave the state as it was. A row after a draft the grammar refuses stays all-allowed: that draft is never
    accepted (its probability is masked to zero on the row before), so its row is never read."""
    if grammar.is_terminated():
        return
    grammar.fill_bitmask(bitmask, first_row)
    if not draft_token_ids:
        return
    if draft_parents is None:
        num_valid = grammar.validate_tokens(list(draft_token_ids))
        num_accepted = 0
        for j in range(num_valid):
            if not grammar.accept_tokens([draft_token_ids[j]]):
                break
            num_accepted += 1
            if grammar.is_terminated():
                break
            grammar.fill_bitmask(bitmask, first_row + j + 1)
        grammar.rollback(num_accepted)
        return
    for node in range(len(draft_token_ids)):
        tokens = [draft_token_ids[n] for n in path(draft_parents, node)]
        if grammar.validate_tokens(tokens) == len(tokens) and grammar.accept_tokens(tokens):
            if not grammar.is_terminated():
                grammar.fill_bitmask(bitmask, first_row + node + 1)
            grammar.rollback(len(tokens))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``logits`` [R, vocab_size] with the tokens ``bitmask`` (host int32 [len(rows), words]) forbids set to -inf in
    ``rows``; a new tensor, ``logits`` itself is not changed. A token past the bitmask's words is forbidden."""
    num_rows, vocab_size = len(rows), logits.shape[-1]
    words = bitmask.to(logits.device, non_blocking=True)  # [num_rows, words]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)  # [32]
    allowed = ((words[:, :, None] >> shifts) & 1).bool().reshape(num_rows, -1)  # [num_rows, words * 32]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab_size]  # [num_rows, vocab_size]
    index = to_device(list(rows), logits.device)  # [num_rows]
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))  # [num_rows, vocab_size]
    return logits.index_copy(0, index, masked)


def _active_grammar(request: Request) -> StructuredOutputGrammar | None:
    constraint = request.structured_output
    if constraint is None or constraint.grammar is None or constraint.grammar.is_terminated():
        return None
    return constraint.grammar


def mask_logits(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """The step's logits (row i: ``requests[i]``'s next token) with every constrained request's row masked to
    what its grammar allows; ``logits`` itself when no request is constrained."""
    grammars = [(row, grammar) for row, request in enumerate(requests) if (grammar := _active_grammar(request))]
    if not grammars:
        return logits
    bitmask = allocate_token_bitmask(len(grammars), logits.shape[-1], logits.device)
    for index, (_, grammar) in enumerate(grammars):
        grammar.fill_bitmask(bitmask, index)
    return apply_token_bitmask(logits, bitmask, [row for row, _ in grammars])


def mask_draft_logits(
    logits: torch.Tensor,
    requests: Sequence[Request],
    draft_token_ids: Sequence[Sequence[int]],
    draft_parents: Sequence[Sequence[int] | None],
) -> torch.Tensor:
    """``mask_logits`` for a step that verifies drafts: request i has ``len(draft_token_ids[i]) + 1`` consecutive
    rows (its next token's, then one after each draft), each masked to what its grammar allows there."""
    starts = [0]
    for drafts in draft_token_ids:
        starts.append(starts[-1] + len(drafts) + 1)
    grammars = [(i, grammar) for i, request in enumerate(requests) if (grammar := _active_grammar(request))]
    if not grammars:
        return logits
    rows = [row for i, _ in grammars for row in range(starts[i], starts[i + 1])]
    bitmask = allocate_token_bitmask(len(rows), logits.shape[-1], logits.device)
    first = 0
    for i, grammar in grammars:
        fill_draft_bitmask(grammar, draft_token_ids[i], draft_parents[i], bitmask, first)
        first += len(draft_token_ids[i]) + 1
    return apply_token_bitmask(logits, bitmask, rows)
