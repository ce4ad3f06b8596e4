"""The scheduler: which requests run each step, and every request's state between steps.

One engine step is three calls (docs/engine.md)::

    scheduler_output = scheduler.schedule()                       # batch, blocks, n > 1 forks
    runner_output = executor.execute(scheduler_output)            # tokens per request, no state changes
    outputs = scheduler.update_from_output(scheduler_output, runner_output)

Everything that changes a request after a step happens in ``update_from_output``:
appending tokens, rolling back rejected drafts (the executor says which it accepted), token-level stop
checks, finishing, freeing blocks and publishing full blocks to the prefix cache. Drafts for the next step
arrive through one call, ``update_draft_token_ids``. The engine loop itself only moves messages and calls
these in order.

Built-in policies (``scheduler.policy``), both token-budget schedulers with
continuous batching, chunked prefill and preemption (see docs/engine.md):

- ``fcfs``: requests run and are admitted in arrival order; the latest arrival
  is preempted first. A request with a nonzero ``priority`` is refused.
- ``priority``: the lowest ``priority`` value runs first (ties by arrival), and
  the request that sorts last is preempted first.

A scheduler never runs the model and never calls hooks; it moves requests
between queues and asks the KV cache manager for blocks. Imports no torch.
"""

from __future__ import annotations

import heapq
import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

from tokenmill.hookspecs import Register, hookimpl
from tokenmill.kv_cache.manager import KVCacheManager, KVTransfers
from tokenmill.messages import EngineCoreOutput, EngineStatsMessage, TokenLogprobs, completion_request_id
from tokenmill.request import PLACEHOLDER_TOKEN_ID as PLACEHOLDER
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import InvalidRequestError
from tokenmill.speculative.draft_tree import num_in_place

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    num_new_tokens: int
    #: Whether this step computes the request's last known token, so a new one is sampled.
    samples_token: bool
    #: Completions 1..n-1 of an n > 1 request, forked this step: they share the request's blocks and
    #: sample their first tokens from its logits row.
    forks: tuple[Request, ...] = ()
    #: Draft tokens verified this step (speculative decoding): the last ``len(draft_token_ids)`` of the
    #: ``num_new_tokens``, after the request's last token. The runner returns the accepted ones plus one.
    draft_token_ids: tuple[int, ...] = ()
    #: When the drafts form a tree (``tokenmill.speculative.draft_tree``): each one's parent; None for a chain.
    draft_parents: tuple[int, ...] | None = None


@dataclass
class SchedulerOutput:
    """What ``schedule`` decided for one step; read by the engine, then handed back to ``update_from_output``."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    #: Copy-on-write block copies (src, dst) the runner performs before the forward.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    #: KV tier transfers (write-back of evicted blocks, prefix blocks to load) due before the copies.
    kv_transfers: KVTransfers = field(default_factory=KVTransfers)
    preempted: list[Request] = field(default_factory=list)
    #: Set by ``mark_in_flight``: the step ran ahead, its computed tokens are counted and its requests hold
    #: placeholders that ``update_from_output`` resolves.
    in_flight: bool = False

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @cached_property
    def sampling_requests(self) -> list[tuple[int, Request]]:
        """``(scheduled index, request)`` for every request that gets a token this step, in sampling-row
        order: each scheduled request that samples, followed by its forks (which share its logits row).
        Read by the engine and again by ``update_from_output``, once the schedule is complete."""
        rows: list[tuple[int, Request]] = []
        for index, scheduled in enumerate(self.scheduled):
            if scheduled.samples_token:
                rows += [(index, request) for request in (scheduled.request, *scheduled.forks)]
        return rows


@dataclass
class ModelRunnerOutput:
    """What the runner and sampler produced for one step, by request id; changes no request state."""

    #: Tokens each sampling request gets, in order: one per step, or when verifying drafts the accepted
    #: drafts followed by the target's own next token (up to k+1).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    #: For each request that verified drafts: the indices of the drafts it accepted, in order (of a chain
    #: ``0..m-1``; of a tree, the accepted path). Missing: none accepted.
    accepted_drafts: dict[str, list[int]] = field(default_factory=dict)
    #: The logprobs of those tokens, for requests that asked for logprobs.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    #: Requests a plugin failed on this step (a logits processor raised): id -> error. They are finished.
    errors: dict[str, str] = field(default_factory=dict)
    #: With ``params.prompt_logprobs``: the prompt tokens whose positions this step computed, in order.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    #: For a speculator that reads them: the final hidden state [hidden_size] of the row that gave each
    #: request's last token. The scheduler ignores them.
    hidden_states: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class DraftTokens:
    """One request's drafts for its next step (``Scheduler.update_draft_token_ids``)."""

    token_ids: list[int]
    #: When they form a tree (``tokenmill.speculative.draft_tree``): each one's parent; None for a chain.
    parents: list[int] | None = None


@dataclass
class SpecDecodingStats:
    """Counters of speculative decoding, named as vLLM's metrics (``spec_decode_*``)."""

    num_drafts: int = 0  # requests that had drafts verified, summed over steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: Index i: how often the draft at position i was accepted.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: ``num_accepted`` of its ``num_drafts`` drafts were kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for position in range(num_accepted):
            per_pos[position] += 1


class Scheduler(ABC):
    """Decides each step's batch and owns every request's state between steps.

    Built once per engine process as ``cls(kv_cache, max_num_batched_tokens=..., max_num_seqs=...)``
    (plus ``options=`` when its plugin declares options). Every method is called from the engine loop, in
    the engine process; none may block, touch tensors or call hooks. A policy that only changes the order
    of requests subclasses ``FCFSScheduler`` and overrides ``sort_key``.
    """

    #: Registered name.
    name: ClassVar[str]
    #: Whether requests may set ``priority``; a scheduler without it refuses a nonzero one.
    supports_priority: ClassVar[bool] = False
    #: Whether it runs requests with LoRA adapters (``Request.lora_request``): the engine then builds it with
    #: ``max_loras=`` too, and it never has requests of more than that many adapters running at once (a request
    #: whose adapter would be one more waits while others run). Without it, an engine with LoRA refuses to start.
    supports_lora: ClassVar[bool] = False

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request. Called once per request; raise ``InvalidRequestError`` to refuse it."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str], completions_only: bool = False) -> list[EngineCoreOutput]:
        """Finish these requests now, wherever they are. A request's id aborts all n of its completions (the
        client went away); with ``completions_only`` each id names one completion (a stop string ended it).
        Unknown ids are ignored. Returns one final output per completion finished: an n > 1 request aborted
        before it forked has only completion 0, whose output carries ``request_finished``."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating their KV slots. Once per step."""

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply a step's results: count computed tokens, append sampled tokens, check stops, finish and
        free. Returns one output per request that gained tokens or finished (token deltas, never text)."""

    #: Whether the engine may schedule a step while the one before still runs on the device (async
    #: scheduling, ``scheduler.async_scheduling``). A scheduler that says so implements ``can_schedule_ahead``
    #: and ``mark_in_flight``, and its ``update_from_output`` resolves the placeholders of an output marked
    #: in flight instead of counting its tokens again.
    supports_async_scheduling: ClassVar[bool] = False

    def can_schedule_ahead(self) -> bool:
        """Whether ``schedule``, called now while the step marked in flight runs, would give every running
        request exactly its placeholder token, admit and preempt nothing, and leave out no request; and no
        request in flight is known to finish with the token it is getting (``max_tokens``, the context
        window). Otherwise the engine first waits for the step in flight. Called once per step."""
        return False

    def mark_in_flight(self, scheduler_output: SchedulerOutput) -> None:
        """The step is launched and its tokens are not known until it finishes: count its computed tokens now
        and give each request that samples a placeholder (``Request.append_placeholder``), so the next step can
        be scheduled while it runs. Requests finished since ``schedule`` (aborted, or stopped by the step
        before) are left alone. Called at most once per output, after the step before was updated."""
        raise NotImplementedError(f"scheduler {self.name!r} does not support async scheduling")

    def update_draft_token_ids(self, drafts: dict[str, DraftTokens]) -> None:
        """Drafts to verify with each named request in its next step (speculative decoding), from the proposer,
        once per step after ``update_from_output``; ids of requests that finished are ignored. The scheduler
        may verify only the first drafts of each (the budget, the KV cache). A scheduler that keeps this
        default ignores drafts: its engine decodes without them."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running. Called every loop iteration."""

    @abstractmethod
    def stats(self) -> EngineStatsMessage:
        """Counters and gauges for metrics and routers; cheap, called after every step."""


class FCFSScheduler(Scheduler):
    """A token-budget scheduler; requests are ordered by ``sort_key`` (here: arrival).

    Each step (see docs/engine.md):

    1. Running requests, in ``sort_key`` order, each get ``min(uncomputed tokens, remaining budget)``
       tokens: one for a generating request, a chunk for one still reading its prompt. When the KV cache
       cannot hold a request's new tokens, the running request that sorts *last* is preempted: its blocks
       are freed and it goes back to the waiting queue to recompute later. If that is the request itself,
       it is the one preempted.
    2. If nothing was preempted, waiting requests are admitted in ``sort_key`` order while the token
       budget, ``max_num_seqs`` and the KV cache last. A new request first reuses every cached block of
       its prompt's prefix.
    """

    name: ClassVar[str] = "fcfs"
    supports_lora: ClassVar[bool] = True

    def __init__(
        self, kv_cache: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int, max_loras: int | None = None
    ) -> None:
        self.kv_cache = kv_cache
        self.max_loras = max_loras
        #: Running requests per adapter (``lora_int_id``): at most ``max_loras`` adapters run at once.
        self.running_loras: Counter[int] = Counter()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self._waiting: list[tuple[Any, Request]] = []  # heap by sort key
        # Per request id (completion 0's): its n, and how many of its completions have not finished yet.
        self._num_completions: dict[str, int] = {}
        self._num_live_completions: dict[str, int] = {}
        #: Outputs of requests that failed while waiting (their constraint did not compile), for the next update.
        self._failed: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.spec_decoding = SpecDecodingStats()

    def sort_key(self, request: Request) -> Any:
        """Scheduling order: smaller runs first and is preempted last. Must be a total order (end with
        the request id) and must not change while the request is queued."""
        return (request.arrival_time, request.request_id)

    # ------------------------------------------------------------ queues

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self._waiting)

    def stats(self) -> EngineStatsMessage:
        return EngineStatsMessage(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv_cache.usage,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            spec_decode_num_drafts=self.spec_decoding.num_drafts,
            spec_decode_num_draft_tokens=self.spec_decoding.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_decoding.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_decoding.num_accepted_tokens_per_pos),
            num_outstanding_tokens=self.num_outstanding_tokens(),
            num_free_kv_blocks=self.kv_cache.num_free_blocks,
            **(self._lora_stats() if self.max_loras is not None else {}),
        )

    def _lora_stats(self) -> dict[str, Any]:
        """The adapters of the running and of the waiting requests (``EngineStatsMessage``'s LoRA fields)."""
        running = {r.lora_request.lora_name: None for r in self.running if r.lora_request is not None}
        waiting = {r.lora_request.lora_name: None for _, r in self._waiting if r.lora_request is not None}
        return {"running_lora_adapters": list(running), "waiting_lora_adapters": list(waiting),
                "max_loras": self.max_loras}  # fmt: skip

    def num_outstanding_tokens(self) -> int:
        """Tokens of work left over the unfinished requests: prompt tokens not computed yet plus tokens still
        to generate (``max_tokens``, else up to the context window). An estimate: a preempted request's
        recomputed output and a stop before ``max_tokens`` are not foreseen. O(requests), a few microseconds
        per hundred; read once per stats message."""
        total = 0
        for request in self.requests.values():
            num_prompt = len(request.prompt_token_ids)
            num_output = len(request.output_token_ids)
            max_tokens = request.params.max_tokens
            limit = request.max_model_len - num_prompt if max_tokens is None else max_tokens
            total += max(0, num_prompt - request.num_computed_tokens) + max(0, limit - num_output)
        return total

    def add_request(self, request: Request) -> None:
        if request.priority != 0 and not self.supports_priority:
            raise InvalidRequestError(
                f"priority={request.priority} was given, but the {self.name!r} scheduler ignores priorities; "
                "start the engine with --scheduling-policy priority"
            )
        if request.lora_request is not None and self.max_loras is None:
            raise InvalidRequestError(
                f"the request names LoRA adapter {request.lora_request.lora_name!r}, but LoRA is not enabled"
            )
        if request.request_id in self.requests or request.request_id in self._num_live_completions:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._num_completions[request.request_id] = request.params.n
        self._num_live_completions[request.request_id] = 1  # its forks add theirs
        self._push_waiting(request)

    def abort_requests(self, request_ids: list[str], completions_only: bool = False) -> list[EngineCoreOutput]:
        outputs = []
        for request_id in request_ids:
            targets = [request_id]
            if not completions_only and request_id in self._num_live_completions:
                targets = [completion_request_id(request_id, i) for i in range(self._num_completions[request_id])]
            for target in targets:
                request = self.requests.get(target)
                if request is not None and not request.is_finished:
                    self._finish(request, RequestStatus.FINISHED_ABORTED)
                    outputs.append(self._output(request, []))
        return outputs

    # ------------------------------------------------------------ the step

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=self.sort_key)
        # Requests later in this list are the preemption candidates, the one that sorts last first.
        candidates = list(self.running)
        for request in list(candidates):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            num_new = min(request.num_uncomputed_tokens, budget)
            drafts = request.spec_token_ids
            if drafts:  # verify the drafts that fit the budget, after the request's last token
                del drafts[max(0, budget - num_new) :]
                if request.spec_parents is not None:  # a tree's first drafts are a tree
                    del request.spec_parents[len(drafts) :]
                num_new += len(drafts)
            allocation = self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens, num_new)
            if allocation is None and drafts:  # drop the drafts before preempting anyone
                num_new -= len(drafts)
                drafts.clear()
                request.spec_parents = None
                allocation = self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens, num_new)
            while allocation is None:
                victim = candidates.pop()
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
                allocation = self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens, num_new)
            if allocation is None:
                continue
            output.block_copies.extend(allocation.copies)
            output.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        if not output.preempted:
            self._admit_waiting(output, budget)
        output.kv_transfers = self.kv_cache.take_transfers()
        started = time.monotonic()
        for scheduled in output.scheduled:
            if scheduled.request.queue_time is None:
                scheduled.request.queue_time = started - scheduled.request.enqueued_at
        return output

    supports_async_scheduling: ClassVar[bool] = True

    def can_schedule_ahead(self) -> bool:
        running = self.running
        # Each running request needs at most one new block: with that many free, nobody is preempted.
        if self._waiting or len(running) > self.max_num_batched_tokens or self.kv_cache.num_free_blocks < len(running):
            return False
        for request in running:
            output_token_ids = request.output_token_ids
            if request.num_uncomputed_tokens != 1 or not output_token_ids or output_token_ids[-1] != PLACEHOLDER:
                return False
            max_tokens = request.params.max_tokens
            if (max_tokens is not None and len(output_token_ids) >= max_tokens) or (
                request.num_tokens >= request.max_model_len
            ):
                return False  # the placeholder is its last token: a step ahead would be wasted
        return True

    def mark_in_flight(self, scheduler_output: SchedulerOutput) -> None:
        assert not scheduler_output.in_flight
        for scheduled in scheduler_output.scheduled:
            if not scheduled.request.is_finished:
                assert not scheduled.draft_token_ids and not scheduled.forks, "drafts and forks do not run ahead"
                scheduled.request.num_computed_tokens += scheduled.num_new_tokens
        for _, request in scheduler_output.sampling_requests:
            if not request.is_finished:
                request.append_placeholder()
        scheduler_output.in_flight = True

    def _admit_waiting(self, output: SchedulerOutput, budget: int) -> None:
        # vLLM's WAITING_FOR_FSM and WAITING_FOR_REMOTE_LORA: passed over until their grammar compiled and their
        # adapter was read (in threads), or until their adapter finds a slot.
        not_ready: list[tuple[Any, Request]] = []
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._waiting[0][1]
            constraint, load = request.structured_output, request.lora_load
            if (constraint is not None and not constraint.is_ready()) or (load is not None and not load.is_ready()):
                not_ready.append(heapq.heappop(self._waiting))
                continue
            error = (constraint.error if constraint is not None else None) or (load.error if load else None)
            if error is not None:  # its grammar did not compile, or its adapter could not be read
                heapq.heappop(self._waiting)
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                self._failed.append(self._output(request, [], error=error))
                continue
            if not self._has_lora_slot(request):  # its adapter finds no slot: it waits, others run
                not_ready.append(heapq.heappop(self._waiting))
                continue
            # A prompt whose logprobs are asked for runs in full: a cached prefix would have no logits.
            prefix_tokens = () if request.needs_prompt_logits else request.all_token_ids
            prefix = self.kv_cache.lookup_prefix(prefix_tokens, request.cache_salt)
            num_new = min(request.num_tokens - prefix.num_tokens, budget)
            allocation = self.kv_cache.allocate_slots(request.request_id, prefix.num_tokens, num_new, prefix)
            if allocation is None:
                break  # the cache is full: wait for running requests to finish
            heapq.heappop(self._waiting)
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = prefix.num_tokens
            request.num_computed_tokens = prefix.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._count_lora(request, 1)
            output.block_copies.extend(allocation.copies)
            output.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        for entry in not_ready:
            heapq.heappush(self._waiting, entry)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        """Schedule ``num_new`` tokens of ``request`` (its drafts included); an n > 1 request about to sample
        its first token forks its other completions now, so they sample from the same logits row."""
        drafts = tuple(request.spec_token_ids)
        parents = tuple(request.spec_parents) if request.spec_parents is not None and drafts else None
        request.spec_token_ids, request.spec_parents = [], None
        samples_token = request.num_computed_tokens + num_new - len(drafts) == request.num_tokens
        forks: tuple[Request, ...] = ()
        if samples_token and request.params.n > 1 and request.parent_id is None and not request.output_token_ids:
            forks = tuple(self._fork(request, index, num_new) for index in range(1, request.params.n))
        return ScheduledRequest(request, num_new, samples_token, forks, drafts, parents)

    def _fork(self, parent: Request, index: int, num_new: int) -> Request:
        child = Request(
            request_id=completion_request_id(parent.request_id, index),
            prompt_token_ids=parent.prompt_token_ids,
            params=parent.params,
            eos_token_ids=parent.eos_token_ids,
            max_model_len=parent.max_model_len,
            arrival_time=parent.arrival_time,
            priority=parent.priority,
            cache_salt=parent.cache_salt,
            lora_request=parent.lora_request,
            lora_load=parent.lora_load,
            parent_id=parent.request_id,
            index=index,
            # Its prompt is computed once this step's forward has run; it is not scheduled before then.
            num_computed_tokens=parent.num_computed_tokens + num_new,
            num_cached_tokens=parent.num_cached_tokens,
            status=RequestStatus.RUNNING,
            enqueued_at=parent.enqueued_at,
            structured_output=parent.structured_output.fork() if parent.structured_output is not None else None,
        )
        self.kv_cache.fork(parent.request_id, child.request_id)
        self.requests[child.request_id] = child
        self._num_live_completions[parent.request_id] += 1
        self.running.append(child)
        self._count_lora(child, 1)
        return child

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        in_flight = scheduler_output.in_flight
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            if in_flight:  # counted by mark_in_flight; aborted since, or stopped by the step before
                if not request.is_finished:
                    self.kv_cache.cache_full_blocks(
                        request.request_id, request.all_token_ids, request.num_computed_tokens, request.cache_salt
                    )
                continue
            token_ids = request.all_token_ids
            num_computed = scheduled.num_new_tokens
            if scheduled.draft_token_ids:
                nodes = self._accepted_drafts(scheduled, runner_output)
                # Rejected drafts' KV is void, and so is that of accepted tree nodes written in another branch's
                # slot: those tokens are recomputed next step (tokenmill.speculative.draft_tree.num_in_place).
                num_kept = len(nodes) if scheduled.draft_parents is None else num_in_place(nodes)
                num_computed -= len(scheduled.draft_token_ids) - num_kept
                token_ids = [*token_ids, *(scheduled.draft_token_ids[node] for node in nodes[:num_kept])]
            request.num_computed_tokens += num_computed
            if num_computed < scheduled.num_new_tokens:
                self.kv_cache.truncate(request.request_id, request.num_computed_tokens)
            self.kv_cache.cache_full_blocks(
                request.request_id, token_ids, request.num_computed_tokens, request.cache_salt
            )
        for request_id, prompt_logprobs in runner_output.prompt_logprobs.items():
            scored = self.requests.get(request_id)
            if scored is not None:  # (it may have finished in this very step)
                scored.prompt_logprobs.extend(prompt_logprobs)
        outputs, self._failed = self._failed, []
        for _, request in scheduler_output.sampling_requests:
            if request.is_finished:
                continue
            error = runner_output.errors.get(request.request_id)
            if error is not None:
                if in_flight:
                    request.drop_placeholder()
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                outputs.append(self._output(request, [], error=error))
                continue
            token_ids = runner_output.sampled_token_ids.get(request.request_id, [])
            logprobs = runner_output.logprobs.get(request.request_id)
            accepted = self._append(request, token_ids, logprobs, resolve=in_flight)
            constraint = request.structured_output
            error = constraint.error if constraint is not None else None
            outputs.append(
                self._output(request, token_ids[:accepted], logprobs[:accepted] if logprobs else None, error=error)
            )
        return outputs

    def _accepted_drafts(self, scheduled: ScheduledRequest, runner_output: ModelRunnerOutput) -> list[int]:
        """The indices of the step's drafts the target accepted, as the executor reports them; counted into the
        speculative-decoding stats."""
        nodes = runner_output.accepted_drafts.get(scheduled.request.request_id, [])
        self.spec_decoding.observe(len(scheduled.draft_token_ids), len(nodes))
        return nodes

    def update_draft_token_ids(self, drafts: dict[str, DraftTokens]) -> None:
        for request_id, draft in drafts.items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING and draft.token_ids:
                token_ids = list(draft.token_ids)
                constraint = request.structured_output
                if constraint is not None:
                    # Only drafts the grammar allows are worth verifying (vLLM trims them the same way).
                    del token_ids[constraint.num_allowed_drafts(token_ids, draft.parents is not None) :]
                    if not token_ids:
                        continue
                request.spec_token_ids = token_ids
                request.spec_parents = list(draft.parents) if draft.parents is not None else None

    def _append(
        self, request: Request, token_ids: list[int], logprobs: list[TokenLogprobs] | None, resolve: bool = False
    ) -> int:
        """Append tokens until one stops the request; returns how many were appended. With ``resolve`` (a step
        that ran ahead: one token) the token replaces the request's placeholder."""
        num_before = len(request.output_token_ids) - resolve
        if token_ids and num_before == 0 and request.parent_id is None:
            self.num_prompt_tokens += request.num_prompt_tokens
        constraint = request.structured_output
        for position, token_id in enumerate(token_ids):
            if constraint is not None and not constraint.accept_tokens([token_id]):
                # Only a backend whose masks are wrong gets here: the request fails, naming the token.
                if resolve:
                    request.drop_placeholder()
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                return position
            if resolve:
                assert len(token_ids) == 1
                request.resolve_placeholder(token_id, logprobs[0] if logprobs else None)
            else:
                request.append_token(token_id, logprobs[position] if logprobs else None)
            self.num_generation_tokens += 1
            status = request.check_stop()
            if status is None and constraint is not None and constraint.is_terminated():
                status = RequestStatus.FINISHED_STOPPED  # the grammar is complete: nothing may follow
            if status is not None:
                self._finish(request, status)
                return position + 1
        return len(token_ids)

    # ------------------------------------------------------------ internals

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(self._waiting, (self.sort_key(request), request))

    def _has_lora_slot(self, request: Request) -> bool:
        """Whether ``request`` may start running as far as adapters go: it has none, its adapter runs already,
        or fewer than ``max_loras`` adapters do."""
        lora = request.lora_request
        if lora is None or lora.lora_int_id in self.running_loras:
            return True
        assert self.max_loras is not None, "add_request refuses adapters without max_loras"
        return len(self.running_loras) < self.max_loras

    def _count_lora(self, request: Request, delta: int) -> None:
        """A request with an adapter started (+1) or stopped (-1) running."""
        if request.lora_request is not None:
            lora_id = request.lora_request.lora_int_id
            self.running_loras[lora_id] += delta
            if self.running_loras[lora_id] <= 0:
                del self.running_loras[lora_id]

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        request.spec_token_ids, request.spec_parents = [], None
        self.running.remove(request)
        self._count_lora(request, -1)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request)
        logger.debug("preempted %s (%d tokens to recompute)", request.request_id, request.num_tokens)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.is_finished:
            return
        was_waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        request.status = status
        request.spec_token_ids, request.spec_parents = [], None
        self.kv_cache.free(request.request_id)
        if was_waiting:  # aborts are rare: an O(n) rebuild keeps the queue exact
            self._waiting = [entry for entry in self._waiting if entry[1] is not request]
            heapq.heapify(self._waiting)
        elif request in self.running:
            self.running.remove(request)
            self._count_lora(request, -1)
        self.requests.pop(request.request_id, None)
        root = request.parent_id or request.request_id
        self._num_live_completions[root] -= 1
        if self._num_live_completions[root] == 0:
            del self._num_live_completions[root], self._num_completions[root]

    def _output(
        self,
        request: Request,
        token_ids: list[int],
        logprobs: list[TokenLogprobs] | None = None,
        error: str | None = None,
    ) -> EngineCoreOutput:
        root = request.parent_id or request.request_id
        first = bool(token_ids) and len(request.output_token_ids) == len(token_ids)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_logprobs=logprobs or None,
            finish_reason=request.status.finish_reason,
            parent_id=request.parent_id,
            index=request.index,
            num_cached_tokens=request.num_cached_tokens,
            error=error,
            # Reported once, with the first token, for the queue-time metric.
            queue_time=request.queue_time if first else None,
            request_finished=request.is_finished and root not in self._num_live_completions,
            prompt_logprobs=request.prompt_logprobs if first and _reports_prompt_logprobs(request) else None,
        )


def _reports_prompt_logprobs(request: Request) -> bool:
    # Completion 0 reports them for all n: the forks share its prompt.
    return request.params.prompt_logprobs is not None and request.parent_id is None


class PriorityScheduler(FCFSScheduler):
    """The token-budget scheduler ordered by request ``priority`` (lower first), then arrival."""

    name: ClassVar[str] = "priority"
    supports_priority: ClassVar[bool] = True

    def sort_key(self, request: Request) -> Any:
        return (request.priority, request.arrival_time, request.request_id)


@hookimpl
def tokenmill_register_schedulers(register: Register) -> None:
    register("fcfs", "tokenmill.scheduler:FCFSScheduler")
    register("priority", "tokenmill.scheduler:PriorityScheduler")
