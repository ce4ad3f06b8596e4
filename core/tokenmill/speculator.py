"""The speculator interface, and the contract by which the core verifies drafts.

A speculator proposes up to ``k`` draft tokens per request from cheap sources
(an n-gram match in the request's own tokens, a small draft model, Medusa
heads). The core then runs the target model once over each request's last
token plus its drafts (k+1 positions) and decides how many drafts to keep:

- **Greedy rows** keep drafts while each equals the target's argmax at its
  position, then append the target's own token at the first mismatch (or a
  bonus token after the last draft when all match): the output is identical,
  token for token, to non-speculative greedy decoding.
- **Sampled rows** use rejection sampling (Leviathan et al. 2023; Chen et al.
  2023): draft ``t`` with draft probability ``q(t)`` is accepted with
  probability ``min(1, p(t) / q(t))`` under the target's processed
  distribution ``p``; the first rejection draws a replacement from
  ``normalise(max(0, p - q))`` and ends the step; when all are accepted a bonus
  token is drawn from ``p`` at the last position. A speculator that returns no
  ``draft_probs`` is taken as deterministic (``q`` is one-hot on its draft).
  Accepted tokens then have exactly the target distribution.

The scheduler appends the accepted tokens (stopping at the first stop
condition), and the KV written for rejected positions is rolled back, so no
block leaks. Logprobs reported are the target model's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SpeculationInput:
    """One request a speculator drafts for this step."""

    request_id: str
    token_ids: Sequence[int]  # prompt then output so far; read only
    num_prompt_tokens: int
    max_num_tokens: int  # drafts beyond this many would pass max_tokens or the context window


@dataclass
class Proposal:
    """Draft tokens per request, in the order of the inputs; an empty list drafts nothing for that request."""

    token_ids: list[list[int]]
    #: Per request, one [num_drafts, vocab_size] float32 tensor of draft probabilities, or None for
    #: deterministic drafts.
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)


class Speculator(ABC):
    """Proposes draft tokens for the core to verify in one target pass.

    Built once per engine process as ``cls(num_speculative_tokens=k)`` (plus ``options=`` when its plugin
    declares options). ``propose`` runs once per step in the engine process, before the target model,
    and must not modify its inputs or call hooks. ``tokenmill.testing.check_speculator`` checks the
    contract: at most ``min(k, max_num_tokens)`` drafts per request, all inside the vocabulary, the same
    drafts for the same inputs.
    """

    #: Registered name.
    name: ClassVar[str]

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    @abstractmethod
    def propose(self, requests: list[SpeculationInput]) -> Proposal:
        """Draft tokens for each request."""

    def on_requests_finished(self, request_ids: list[str]) -> None:
        """Forget per-request state (a draft model's KV, say); called once per finished request."""
