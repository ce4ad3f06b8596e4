"""The proposer: after each step, asks the speculator for the next step's drafts and hands them to the scheduler.

It owns the engine's side of a speculator: building it from ``[speculative_config]``, choosing who drafts
and how many tokens (the draft policy), checking what the speculator returns, keeping the draft
distributions until the executor verifies them, and telling the speculator which requests left. Runs in the
engine process, once per step, after ``Scheduler.update_from_output``.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.memory import CacheLayout
from tokenmill.messages import EngineCoreOutput
from tokenmill.model_loader import LoadedModel
from tokenmill.plugin_manager import PluginSystem, Slot
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling.sampler import Sampler
from tokenmill.scheduler import DraftTokens, ModelRunnerOutput, SchedulerOutput
from tokenmill.speculative.draft_policy import DraftPolicy
from tokenmill.speculative.draft_tree import check_parents, parse_token_tree
from tokenmill.speculative.speculator import SpeculationInput, Speculator, SpeculatorContext

logger = logging.getLogger(__name__)

#: ``SamplingParams.extra_args`` key (``vllm_xargs`` over HTTP): true turns speculation off for the request.
DISABLE_SPECULATION = "disable_speculation"


class Proposer:
    """Drafts for the requests that decode next step, through the configured speculator."""

    def __init__(self, speculator: Speculator, disable_by_batch_size: int | None, draft_policy: str) -> None:
        self.speculator = speculator
        self.disable_by_batch_size = disable_by_batch_size
        #: With ``draft_policy = "goodput"``: how many drafts each request gets (None: always as many as fit).
        self.draft_policy = DraftPolicy(speculator.num_speculative_tokens) if draft_policy == "goodput" else None
        #: The draft distributions of each request's latest drafts, until they are verified.
        self._draft_probs: dict[str, torch.Tensor] = {}
        #: The requests of the last ``propose`` call (a new one's first call also reads its prompt).
        self._drafted_last_step: set[str] = set()

    @property
    def needs_hidden_states(self) -> bool:
        return self.speculator.needs_hidden_states

    def forget(self, request_ids: list[str]) -> None:
        """Drop what is kept for requests that finished, were aborted or preempted."""
        if not request_ids:
            return
        self.speculator.on_requests_finished(request_ids)
        if self.draft_policy is not None:
            self.draft_policy.forget(request_ids)
        for request_id in request_ids:
            self._draft_probs.pop(request_id, None)

    def take_draft_probs(self, request_id: str, num_drafts: int) -> torch.Tensor | None:
        """The draft distributions of the request's scheduled drafts (the scheduler may have verified only the
        first ``num_drafts``); spent by the call."""
        probs = self._draft_probs.pop(request_id, None)
        return probs[:num_drafts] if probs is not None and num_drafts else None

    def observe_step(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """The time the executor took for a step, before its update (for the draft policy's cost model)."""
        scheduled = scheduler_output.scheduled
        # Decode and verification steps only: a prompt chunk's cost per token says nothing about drafts' (the
        # last chunk of a prompt samples a token too, but its request has none yet).
        if self.draft_policy is not None and all(s.samples_token and s.request.output_token_ids for s in scheduled):
            drafted = any(s.draft_token_ids for s in scheduled)
            self.draft_policy.observe_step(scheduler_output.num_scheduled_tokens, seconds, drafted)

    def propose(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, outputs: list[EngineCoreOutput]
    ) -> dict[str, DraftTokens]:
        """Forget the requests that left, then draft for the requests that decode next step (they got a token this
        step and are still running), as many tokens each as the draft policy allows. Nothing is drafted in a
        step of ``disable_by_batch_size`` requests or more, or for a request that opted out. A speculator that
        raises drafts nothing this step."""
        gone = [output.request_id for output in outputs if output.finish_reason is not None]
        self.forget(gone + [request.request_id for request in scheduler_output.preempted])
        cap = self.disable_by_batch_size
        if cap and len(scheduler_output.scheduled) >= cap:
            return {}
        speculator = self.speculator
        candidates = [
            request for _, request in scheduler_output.sampling_requests
            if request.status == RequestStatus.RUNNING
            and not (request.params.extra_args or {}).get(DISABLE_SPECULATION)
        ]  # fmt: skip
        limits = [min(_max_draft_tokens(request), speculator.num_speculative_tokens) for request in candidates]
        if self.draft_policy is not None:
            num_drafted = sum(len(s.draft_token_ids) for s in scheduler_output.scheduled)
            limits = self.draft_policy.num_drafts(
                [request.request_id for request in candidates], limits,
                scheduler_output.num_scheduled_tokens - num_drafted,
            )  # fmt: skip
        hidden_states = runner_output.hidden_states
        inputs = [
            SpeculationInput(request.request_id, request.all_token_ids, request.num_prompt_tokens, limit,
                             hidden_states.get(request.request_id))
            for request, limit in zip(candidates, limits, strict=True) if limit > 0
        ]  # fmt: skip
        if not inputs:
            return {}
        started = time.perf_counter()
        try:
            proposal = speculator.propose(inputs)
        except Exception:  # a plugin's failure costs this step's drafts, never the engine
            logger.exception("speculator %r failed; drafting nothing this step", speculator.name)
            return {}
        drafted = {item.request_id for item in inputs}
        if self.draft_policy is not None and drafted <= self._drafted_last_step:
            longest = max((len(t) for t in proposal.token_ids), default=0)
            self.draft_policy.observe_propose(longest, time.perf_counter() - started)
        self._drafted_last_step = drafted
        draft_probs = proposal.draft_probs or [None] * len(inputs)
        tree_parents = proposal.parents or [None] * len(inputs)
        drafts: dict[str, DraftTokens] = {}
        for item, token_ids, probs, parents in zip(inputs, proposal.token_ids, draft_probs, tree_parents, strict=True):
            self._draft_probs.pop(item.request_id, None)  # never verify against an earlier step's distributions
            draft = self._checked(item, token_ids, parents, probs)
            if draft is None:
                continue
            drafts[item.request_id] = draft
            if probs is not None:
                self._draft_probs[item.request_id] = probs
        return drafts

    def _checked(
        self, item: SpeculationInput, token_ids: list[int], parents: list[int] | None, probs: torch.Tensor | None
    ) -> DraftTokens | None:
        """The request's drafts cut to what it may verify; None when there are none, or when the speculator gave
        a bad tree (its bug costs this request's drafts, never the engine)."""
        token_ids = list(token_ids[: item.max_num_tokens])
        if not token_ids:
            return None
        if parents is None:
            return DraftTokens(token_ids)
        parents = list(parents[: item.max_num_tokens])
        context = self.speculator.context
        try:
            if context is None or not context.verifies_draft_trees:
                raise ValueError("this engine verifies chains of drafts only")
            if probs is not None:
                raise ValueError("draft trees are deterministic: it gave draft_probs too")
            check_parents(parents, token_ids)
        except ValueError as exc:
            logger.error("speculator %r proposed a bad draft tree for %s (%s); drafting nothing for it",
                         self.speculator.name, item.request_id, exc)  # fmt: skip
            return None
        return DraftTokens(token_ids, parents)


def build_proposer(
    config: EngineConfig, sampler: Sampler, loaded: LoadedModel, plugins: PluginSystem, layout: CacheLayout
) -> Proposer | None:
    """The proposer for ``[speculative_config]``, or None when there is no speculator (or the sampler cannot
    verify drafts). Raises ``ConfigError`` for a draft tree this engine cannot verify."""
    spec = config.speculative_config
    if spec.method is None:
        return None
    if not sampler.verifies_drafts:
        logger.warning("sampler %r cannot verify drafts (no target_probs): speculative decoding is off", sampler.name)
        return None
    cls = plugins.load(Slot.SPECULATOR, spec.method)
    k = spec.num_speculative_tokens or cls.default_num_speculative_tokens
    if spec.speculative_token_tree is not None:
        if not cls.supports_draft_trees:
            raise ConfigError(f"speculative_config.speculative_token_tree is set, but speculator {spec.method!r} "
                              "drafts chains only; unset it")  # fmt: skip
        k = len(parse_token_tree(spec.speculative_token_tree))
    # A sliding window counts positions in the text, which a tree's nodes share; kept out rather than approximated.
    windowed = any(window is not None for window in loaded.arch.sliding_windows)
    verifies_trees = loaded.attention.supports_draft_trees and not windowed
    if spec.speculative_token_tree is not None and not verifies_trees:
        reason = "the model has sliding-window layers" if windowed else (
            f"attention backend {loaded.attention.name!r} cannot verify them; use the 'cpu' or 'torch' "
            "backend, or unset it"
        )  # fmt: skip
        raise ConfigError(f"speculative_config.speculative_token_tree is set, but this engine cannot verify draft "
                          f"trees: {reason}")  # fmt: skip
    context = SpeculatorContext(config, loaded, plugins, layout.block_size, layout.num_blocks, verifies_trees)
    speculator: Speculator = plugins.instantiate(
        Slot.SPECULATOR, spec.method, cls, num_speculative_tokens=k, context=context
    )
    logger.info("speculative decoding: %s, %d draft tokens", spec.method, speculator.num_speculative_tokens)
    return Proposer(speculator, spec.disable_by_batch_size, spec.draft_policy)


def _max_draft_tokens(request: Request) -> int:
    """Drafts a request may verify next step: one step yields up to drafts + 1 tokens, which must not pass
    ``max_tokens``, and the drafts' positions must fit the context window."""
    limit = request.max_model_len - request.num_tokens
    if request.params.max_tokens is not None:
        limit = min(limit, request.params.max_tokens - len(request.output_token_ids) - 1)
    return limit
