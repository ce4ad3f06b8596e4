"""The ``draft_model`` speculator: a smaller or quantized model with the target's vocabulary drafts greedily.

The draft model is loaded with the target's loader and settings (device,
dtype, attention backend, KV cache dtype), only ``model.model`` and
``model.quantization`` replaced by ``speculative_config.model`` and
``speculative_config.quantization``. It runs on its own ``ModelRunner`` with
its own paged KV cache, as many tokens as the target's.

Each ``propose`` runs, for every request that drafts:

1. one batched forward that catches each request up: the tokens the draft
   cache does not hold yet (normally the accepted drafts' successor and the
   target's own token; the whole prompt the first time), logits of the last
   token only; its argmax is draft 1;
2. ``k - 1`` batched one-token forwards, each feeding the previous draft:
   drafts 2..k.

Keeping the draft cache in step: after a step the target has kept a prefix of
the drafts and appended a token of its own, so the next ``token_ids`` agree
with the tokens the draft cache holds up to some position and then differ.
The draft cache keeps the longest common prefix (at most all tokens but the
last: their logits are needed) and overwrites the slots after it. Drafts are
greedy and returned without probabilities, so the core treats them as
deterministic, which is exact for sampled requests too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import msgspec
import torch

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.cuda_graphs import cuda_graph_batch_sizes
from tokenmill.kv_cache.block_pool import BlockPool
from tokenmill.model_loader import LoadedModel, load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk
from tokenmill.speculative.speculator import Proposal, SpeculationInput, Speculator, SpeculatorContext
from tokenmill.tokenizer import Tokenizer

__all__ = ["DraftModelSpeculator"]

logger = logging.getLogger(__name__)


@dataclass
class _DraftState:
    """One request's share of the draft cache."""

    token_ids: list[int] = field(default_factory=list)  # the tokens whose K/V the draft cache holds, in order
    block_ids: list[int] = field(default_factory=list)  # its block table in the draft cache
    #: Leading ``token_ids`` that came from the core (the last input's ``token_ids``): the core only appends
    #: after them, so they are never compared again.
    num_from_core: int = 0


class DraftModelSpeculator(Speculator):
    """Drafts ``k`` tokens per request with a second, cheaper model of the same vocabulary.

    Built once per engine process with the engine's ``SpeculatorContext`` (it cannot run without one: it
    loads a model). Raises ``ConfigError`` when ``speculative_config.model`` is missing or the draft's
    vocabulary differs from the target's. When its KV cache cannot hold a request's tokens plus its drafts,
    that request gets no drafts this step; the engine never fails for it.
    """

    name: ClassVar[str] = "draft_model"
    default_num_speculative_tokens: ClassVar[int] = 4

    def __init__(self, num_speculative_tokens: int, context: SpeculatorContext | None = None) -> None:
        super().__init__(num_speculative_tokens, context)
        if context is None:
            raise ConfigError("the 'draft_model' speculator runs inside an engine only: it needs a SpeculatorContext")
        spec = context.config.speculative_config
        if not spec.model:
            raise ConfigError("speculative_config.model is unset: give the draft model's path for 'draft_model'")
        self.draft: LoadedModel = load_model(_draft_config(context.config, context.target), context.plugins)
        _check_vocabularies(context.config, context.target, self.draft)
        config = context.config
        graph_batch_sizes = cuda_graph_batch_sizes(
            config.device.cuda_graphs, config.device.cuda_graph_batch_sizes, config.scheduler.max_num_seqs,
            self.draft.device, self.draft.attention, self.draft.model,
        )  # fmt: skip
        # As many blocks of the same size as the target's cache: every request the target holds fits here too
        # (the draft needs one slot fewer per request than the target's verification step).
        self.runner = ModelRunner(
            self.draft, context.num_kv_blocks, context.block_size, cuda_graph_batch_sizes=graph_batch_sizes
        )
        self.block_size = context.block_size
        self._pool = BlockPool(context.num_kv_blocks)
        self._states: dict[str, _DraftState] = {}
        logger.info(
            "draft_model speculator: %s drafts %d tokens per step, KV cache of %d blocks of %d tokens",
            self.draft.path,
            num_speculative_tokens,
            context.num_kv_blocks,
            context.block_size,
        )

    @torch.inference_mode()
    def propose(self, requests: list[SpeculationInput]) -> Proposal:
        """Greedy drafts for each request: one catch-up forward, then ``k - 1`` one-token forwards, each
        batched over the requests still drafting. Called once per step by the engine."""
        drafts: list[list[int]] = [[] for _ in requests]
        drafting: list[tuple[list[int], _DraftState, int]] = []  # (its drafts, its state, how many to draft)
        chunks: list[SequenceChunk] = []
        for item, request_drafts in zip(requests, drafts, strict=True):
            num_drafts = min(self.num_speculative_tokens, item.max_num_tokens)
            if num_drafts <= 0:
                continue
            state = self._states.get(item.request_id)
            if state is None:
                state = self._states[item.request_id] = _DraftState()
            token_ids = item.token_ids
            num_tokens = len(token_ids)
            # Keep the common prefix, but always recompute the last token: its logits give draft 1.
            num_computed = min(_num_common_tokens(state, token_ids), num_tokens - 1)
            # Slots for the new tokens and the drafts fed back in (the last draft is never fed).
            if not self._reserve(state, num_tokens + num_drafts - 1):
                # Drop what it holds so that the requests that do fit can use the space; it recomputes
                # once the cache has room again.
                self._free(item.request_id)
                continue
            new_token_ids = list(token_ids[num_computed:])
            del state.token_ids[num_computed:]
            state.token_ids.extend(new_token_ids)
            state.num_from_core = num_tokens
            chunks.append(SequenceChunk(new_token_ids, num_computed, state.block_ids))
            drafting.append((request_drafts, state, num_drafts))

        while drafting:
            next_tokens = self.runner.execute(chunks).argmax(dim=-1).tolist()  # [num_drafting]
            still_drafting: list[tuple[list[int], _DraftState, int]] = []
            chunks = []
            for (request_drafts, state, num_drafts), token_id in zip(drafting, next_tokens, strict=True):
                request_drafts.append(token_id)
                if len(request_drafts) < num_drafts:
                    chunks.append(SequenceChunk([token_id], len(state.token_ids), state.block_ids))
                    state.token_ids.append(token_id)
                    still_drafting.append((request_drafts, state, num_drafts))
            drafting = still_drafting
        return Proposal(drafts)

    def on_requests_finished(self, request_ids: list[str]) -> None:
        """Free the draft cache blocks of requests that finished, were aborted or were preempted."""
        for request_id in request_ids:
            self._free(request_id)

    @property
    def num_free_blocks(self) -> int:
        """Blocks of the draft cache that no request holds."""
        return self._pool.num_free_blocks

    def _reserve(self, state: _DraftState, num_tokens: int) -> bool:
        """Make the request's block table exactly cover ``num_tokens`` tokens (freeing blocks past them, which
        hold rejected drafts), or return False, changing nothing, when the cache has too few free blocks."""
        num_needed = -(-num_tokens // self.block_size) - len(state.block_ids)
        if num_needed < 0:
            self._pool.free(reversed(state.block_ids[num_needed:]))
            del state.block_ids[num_needed:]
        elif num_needed > 0:
            if num_needed > self._pool.num_free_blocks:
                return False
            state.block_ids.extend(self._pool.allocate(num_needed))
        return True

    def _free(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self._pool.free(reversed(state.block_ids))


def _num_common_tokens(state: _DraftState, token_ids: Sequence[int]) -> int:
    """How many leading ``token_ids`` the draft cache holds already (the longest common prefix).

    Between calls the core only appends after the tokens it gave last time (``num_from_core``), so the
    comparison starts at the last of those: a few tokens per step, not the whole sequence. If even that one
    differs, the request id was reused without ``on_requests_finished``; compare from the start then.
    """
    cached = state.token_ids
    limit = min(len(cached), len(token_ids))
    start = min(state.num_from_core, limit)
    if start and cached[start - 1] != token_ids[start - 1]:
        start = 0
    while start < limit and cached[start] == token_ids[start]:
        start += 1
    return start


def _draft_config(config: EngineConfig, target: LoadedModel) -> EngineConfig:
    """The target's config with the draft model in ``model``: the same device, dtype, attention and KV cache
    settings. The draft's positions reach as far as the target's (its context length is the target's)."""
    spec = config.speculative_config
    assert spec.model is not None
    model = msgspec.structs.replace(
        config.model,
        model=spec.model,
        quantization=spec.quantization or "auto",
        tokenizer=None,
        weight_format=None,  # the draft's file may be of another format: recognise it
        max_model_len=target.max_model_len,
    )
    return msgspec.structs.replace(config, model=model)


def _check_vocabularies(config: EngineConfig, target: LoadedModel, draft: LoadedModel) -> None:
    """Raise ``ConfigError`` unless draft and target map the same ids to the same tokens.

    The vocabulary sizes must be equal. When both models come with a tokenizer, their vocabularies
    (token string -> id, added tokens included) must be equal too: a draft of another tokenizer with the
    same size would draft ids that mean other tokens, and the target would reject nearly every one.
    Loading two tokenizers costs a fraction of a second, once, at start-up.
    """
    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ConfigError(
            f"speculative_config.model: the draft model {draft.path} has a vocabulary of {draft.arch.vocab_size} "
            f"ids, the target {target.arch.vocab_size}; choose a draft model with the target's tokenizer"
        )
    target_tokenizer = Path(config.model.tokenizer) if config.model.tokenizer else target.path
    if draft.path.resolve() == target_tokenizer.resolve():
        return
    try:
        draft_vocab = Tokenizer.from_path(draft.path).backend.get_vocab(with_added_tokens=True)
        target_vocab = Tokenizer.from_path(target_tokenizer).backend.get_vocab(with_added_tokens=True)
    except ValueError as exc:  # a model without tokenizer files: the sizes agree, which is all we can check
        logger.info("draft_model: vocabularies not compared, a tokenizer is missing (%s)", exc)
        return
    if draft_vocab != target_vocab:
        draft_tokens = {i: t for t, i in draft_vocab.items()}
        target_tokens = {i: t for t, i in target_vocab.items()}
        token_id = min(
            i for i in draft_tokens.keys() | target_tokens.keys() if draft_tokens.get(i) != target_tokens.get(i)
        )
        raise ConfigError(
            f"speculative_config.model: the draft model {draft.path} has another tokenizer than the target "
            f"(id {token_id} is {draft_tokens.get(token_id)!r} there, {target_tokens.get(token_id)!r} in the "
            "target); choose a draft model with the target's tokenizer"
        )
