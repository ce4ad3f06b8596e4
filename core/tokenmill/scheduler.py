"""The FCFS token-budget scheduler: continuous batching with chunked prefill and preemption.

Policy, each step (see docs/engine.md):

1. Running requests, in ``(priority, arrival)`` order, each get
   ``min(uncomputed tokens, remaining budget)`` tokens: one for a generating
   request, a chunk for one still reading its prompt. When the KV cache cannot
   hold a request's new tokens, the running request that sorts *last* (lowest
   priority, latest arrival) is preempted: its blocks are freed and it goes back
   to the waiting queue to recompute later. If that is the request itself, it
   is the one preempted.
2. If nothing was preempted, waiting requests are admitted in ``(priority,
   arrival)`` order while the token budget, ``max_num_seqs`` and the KV cache
   last. A new request first reuses every cached block of its prompt's prefix.

The scheduler never runs the model and never calls hooks; it moves requests
between queues and asks the KV cache manager for blocks.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field

from tokenmill.kv_cache.manager import KVCacheManager
from tokenmill.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples_token(self) -> bool:
        """Whether this step computes the request's last known token, so a new one is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    #: Copy-on-write block copies (src, dst) the runner performs before the forward.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting and running queues. Called by the engine loop, once per step."""

    def __init__(self, kv_cache: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.kv_cache = kv_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self._waiting: list[tuple[tuple[int, float, str], Request]] = []  # heap by sort key
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self._waiting)

    def add_request(self, request: Request) -> None:
        """Queue a new request (or a preempted one) for admission."""
        self.requests[request.request_id] = request
        heapq.heappush(self._waiting, (request.sort_key, request))

    def add_running(self, request: Request) -> None:
        """Start a request that already holds blocks (a forked completion of an n > 1 request)."""
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request now, wherever it is, freeing its blocks. Unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=lambda r: r.sort_key)
        # Requests later in this list are the preemption candidates, lowest priority last.
        candidates = list(self.running)
        for request in list(candidates):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            num_new = min(request.num_uncomputed_tokens, budget)
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
            output.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        if not output.preempted:
            budget = self._admit_waiting(output, budget)
        return output

    def _admit_waiting(self, output: SchedulerOutput, budget: int) -> int:
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._waiting[0][1]
            prefix = self.kv_cache.lookup_prefix(request.all_token_ids, request.cache_salt)
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
            output.block_copies.extend(allocation.copies)
            output.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return budget

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        heapq.heappush(self._waiting, (request.sort_key, request))
        logger.debug("preempted %s (%d tokens to recompute)", request.request_id, request.num_tokens)

    def finish_computed(self, scheduled: ScheduledRequest) -> None:
        """Record that a step computed ``scheduled``'s tokens and publish its full blocks for reuse."""
        request = scheduled.request
        request.num_computed_tokens += scheduled.num_new_tokens
        self.kv_cache.cache_full_blocks(
            request.request_id, request.all_token_ids, request.num_computed_tokens, request.cache_salt
        )

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a running request (stopped or out of length) and free its blocks."""
        self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.is_finished:
            return
        was_waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        request.status = status
        self.kv_cache.free(request.request_id)
        if was_waiting:  # aborts are rare: an O(n) rebuild keeps the queue exact
            self._waiting = [entry for entry in self._waiting if entry[1] is not request]
            heapq.heapify(self._waiting)
        elif request in self.running:
            self.running.remove(request)
        self.requests.pop(request.request_id, None)
