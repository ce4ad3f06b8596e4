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

A speculator with ``supports_draft_trees`` may propose a **tree** of drafts instead of a chain
(``Proposal.parents``, ``tokenmill.speculative.draft_tree``): several candidates per position, each node scored by the
target in the same pass while seeing only its own ancestors. Verification walks down from the request's
last token, accepting at each node the first child that passes (for a greedy row: the child that is the
target's argmax; for a sampled row: child ``c`` with probability ``r(c)``, where ``r`` starts as ``p`` and
loses each rejected child's token and is renormalised, SpecInfer's rule for deterministic drafts), and ends
with a token drawn from what is left of ``r``: exactly the target's distribution again. Tree drafts are
deterministic (no ``draft_probs``).

When drafts are made: after each step, for every running request that will
decode next step (its prompt computed, not finished), in one ``propose`` call
per step. The drafts ride on the request (``Request.spec_token_ids``) into the
next ``schedule``. Configuration: ``[speculative_config]`` (vLLM's
``--speculative-config``), see ``tokenmill.config.speculative``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.model_loader import LoadedModel
    from tokenmill.plugin_manager import PluginSystem


@dataclass(frozen=True)
class SpeculationInput:
    """One request a speculator drafts for this step."""

    request_id: str
    token_ids: Sequence[int]  # prompt then output so far; read only
    num_prompt_tokens: int
    max_num_tokens: int  # drafts beyond this many would pass max_tokens or the context window
    #: [hidden_size] the target's final hidden state (after its last norm) at the position whose logits gave
    #: the request's last token; only for a speculator whose ``needs_hidden_states`` is true, else None.
    hidden_state: torch.Tensor | None = None


@dataclass(frozen=True)
class SpeculatorContext:
    """What a speculator may read about the engine it drafts for; given at construction. Read only."""

    config: EngineConfig  # the whole engine config; ``config.speculative_config`` is the speculator's table
    target: LoadedModel  # the target model: its architecture, device, dtype, path, the module itself
    plugins: PluginSystem  # to load a draft model through the same loader and plugins
    block_size: int  # tokens per block of the target's paged KV cache
    num_kv_blocks: int  # blocks in the target's KV cache: a draft model's own cache can hold as many tokens
    #: Whether the engine verifies draft trees (its attention backend applies tree masks); when False a
    #: speculator must propose chains.
    verifies_draft_trees: bool = False


@dataclass
class Proposal:
    """Draft tokens per request, in the order of the inputs; an empty list drafts nothing for that request."""

    token_ids: list[list[int]]
    #: Per request, one [num_drafts, vocab_size] float32 tensor of draft probabilities, or None for
    #: deterministic drafts.
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)
    #: Per request, the parent of each draft when they form a tree (``tokenmill.speculative.draft_tree``), or None for a
    #: chain; empty: chains only. A tree's first ``m`` drafts must be a tree too (the engine may keep only
    #: those), which any order with parents before children gives.
    parents: list[list[int] | None] = field(default_factory=list)


class Speculator(ABC):
    """Proposes draft tokens for the core to verify in one target pass.

    Built once per engine process as ``cls(num_speculative_tokens=k, context=SpeculatorContext)`` (plus
    ``options=`` when its plugin declares options); ``k`` is ``speculative_config.num_speculative_tokens``,
    or ``default_num_speculative_tokens`` when that is unset. ``context`` is None when built outside an
    engine (the conformance check), so a speculator that needs no model must work without it.
    ``propose`` runs once per step in the engine process, after the step's target pass, for the requests
    that decode next; it must not modify its inputs or call hooks. ``tokenmill.testing.check_speculator`` checks the
    contract: at most ``min(k, max_num_tokens)`` drafts per request, all inside the vocabulary, the same
    drafts for the same inputs.
    """

    #: Registered name.
    name: ClassVar[str]
    #: Whether ``propose`` needs ``SpeculationInput.hidden_state`` (Medusa heads read the target's).
    needs_hidden_states: ClassVar[bool] = False
    #: ``k`` when ``speculative_config.num_speculative_tokens`` is unset.
    default_num_speculative_tokens: ClassVar[int] = 3
    #: Whether it may propose draft trees (``Proposal.parents``); it then reads the tree's shape from
    #: ``speculative_config.speculative_token_tree`` and drafts chains when ``context.verifies_draft_trees``
    #: is False. ``k`` counts a tree's nodes.
    supports_draft_trees: ClassVar[bool] = False

    def __init__(self, num_speculative_tokens: int, context: SpeculatorContext | None = None) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.context = context

    @abstractmethod
    def propose(self, requests: list[SpeculationInput]) -> Proposal:
        """Draft tokens for each request."""

    def on_requests_finished(self, request_ids: list[str]) -> None:
        """Forget per-request state (a draft model's KV, say). Called, after a step, for each request that
        finished, was aborted or was preempted (it recomputes later; ``propose`` sees it again then)."""
