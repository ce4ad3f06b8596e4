"""``check_speculator``: drafts within bounds, in the vocabulary, deterministic, with valid probabilities."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.speculative.draft_tree import check_parents
from tokenmill.speculative.speculator import Proposal, SpeculationInput, Speculator
from tokenmill.testing.conformance._util import calling, conformance_check, fail


def _inputs(vocab_size: int) -> list[SpeculationInput]:
    repeating = [5, 6, 7, 8] * 6  # an n-gram speculator finds continuations here
    return [
        SpeculationInput("repeating", repeating, num_prompt_tokens=12, max_num_tokens=10),
        SpeculationInput("one-left", repeating[:-1], num_prompt_tokens=12, max_num_tokens=1),
        SpeculationInput("none-left", repeating, num_prompt_tokens=12, max_num_tokens=0),
        SpeculationInput("prompt-only", [vocab_size - 1, 3, vocab_size - 1, 3], num_prompt_tokens=4, max_num_tokens=8),
        SpeculationInput("varied", [(t * 37) % vocab_size for t in range(30)], num_prompt_tokens=20, max_num_tokens=9),
    ]


@conformance_check
def check_speculator(
    speculator: Callable[..., Speculator] | Speculator,
    *,
    num_speculative_tokens: int = 3,
    vocab_size: int = 64,
) -> None:
    """Check a speculator against the ``Speculator`` contract (``tokenmill.speculative.speculator``).

    ``propose`` returns one draft list per input, in order, each at most ``min(num_speculative_tokens,
    max_num_tokens)`` long and inside the vocabulary; the same drafts for the same inputs; no input changed.
    ``draft_probs``, when given, has one entry per input: None or a [num_drafts, vocab_size] float32 tensor
    of probabilities (non-negative, rows summing to 1) under which each draft token is possible.
    ``parents``, when given, has one entry per input: None (a chain) or a draft tree over that input's drafts
    (``tokenmill.speculative.draft_tree``: each parent -1 or an earlier draft, siblings distinct), from a
    speculator that declares ``supports_draft_trees``, and never together with ``draft_probs`` for the same input.
    ``on_requests_finished`` accepts the ids.

    :param speculator: the class or a factory, called as ``speculator(num_speculative_tokens=k)``, or an
        instance built with ``num_speculative_tokens``.
    :raises AssertionError: naming the request and what is wrong.
    """
    candidate = (
        speculator if isinstance(speculator, Speculator) else speculator(num_speculative_tokens=num_speculative_tokens)
    )
    name = type(candidate).__name__
    k = candidate.num_speculative_tokens
    inputs = _inputs(vocab_size)
    snapshot = [list(item.token_ids) for item in inputs]
    proposals: list[Proposal] = []
    for _ in range(2):
        with calling(f"{name}.propose"):
            proposals.append(candidate.propose(list(inputs)))
    proposal = proposals[0]
    if [list(item.token_ids) for item in inputs] != snapshot:
        fail(f"{name}.propose changed the token ids it was given; they are read-only")
    if not isinstance(proposal, Proposal) or len(proposal.token_ids) != len(inputs):
        fail(f"{name}.propose must return a Proposal with one draft list per input ({len(inputs)}), got "
             f"{proposal!r}")  # fmt: skip
    if proposals[1].token_ids != proposal.token_ids:
        fail(f"{name}.propose drafted {proposal.token_ids}, then {proposals[1].token_ids} for the same inputs")
    for item, drafts in zip(inputs, proposal.token_ids, strict=True):
        limit = min(k, item.max_num_tokens)
        if len(drafts) > limit:
            fail(f"{name}: {len(drafts)} drafts for {item.request_id!r}, at most min(k={k}, "
                 f"max_num_tokens={item.max_num_tokens}) = {limit} allowed")  # fmt: skip
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in drafts):
            fail(f"{name}: drafts {drafts} for {item.request_id!r} are not token ids in [0, {vocab_size})")
    if proposal.draft_probs:
        _check_draft_probs(name, inputs, proposal, vocab_size)
    if proposal.parents:
        _check_parents(name, candidate, inputs, proposal)
    with calling(f"{name}.on_requests_finished"):
        candidate.on_requests_finished([item.request_id for item in inputs])


def _check_draft_probs(name: str, inputs: list[SpeculationInput], proposal: Proposal, vocab_size: int) -> None:
    if len(proposal.draft_probs) != len(inputs):
        fail(f"{name}: draft_probs has {len(proposal.draft_probs)} entries for {len(inputs)} inputs")
    for item, drafts, probs in zip(inputs, proposal.token_ids, proposal.draft_probs, strict=True):
        if probs is None:
            continue
        where = f"{name}: draft_probs of {item.request_id!r}"
        if tuple(probs.shape) != (len(drafts), vocab_size) or probs.dtype != torch.float32:
            fail(f"{where} is {tuple(probs.shape)} {probs.dtype}, expected ({len(drafts)}, {vocab_size}) float32")
        probs = probs.cpu()
        if bool((probs < 0).any()) or not torch.allclose(probs.sum(-1), torch.ones(len(drafts)), atol=1e-4):
            fail(f"{where} are not probability distributions (non-negative, each row summing to 1)")
        if drafts and bool((probs[torch.arange(len(drafts)), torch.tensor(drafts)] <= 0).any()):
            fail(f"{where} give a drafted token probability 0")


def _check_parents(name: str, candidate: Speculator, inputs: list[SpeculationInput], proposal: Proposal) -> None:
    if not candidate.supports_draft_trees:
        fail(f"{name} proposes parents (draft trees) but does not declare supports_draft_trees")
    if len(proposal.parents) != len(inputs):
        fail(f"{name}: parents has {len(proposal.parents)} entries for {len(inputs)} inputs")
    probs = proposal.draft_probs or [None] * len(inputs)
    for item, drafts, parents, q in zip(inputs, proposal.token_ids, proposal.parents, probs, strict=True):
        if parents is None:
            continue
        try:
            check_parents(parents, drafts)
        except ValueError as exc:
            fail(f"{name}: the draft tree of {item.request_id!r} is not a tree: {exc}")
        if q is not None:
            fail(f"{name}: {item.request_id!r} has a draft tree and draft_probs; tree drafts are deterministic")
