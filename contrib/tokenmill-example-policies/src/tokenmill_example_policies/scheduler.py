"""``shortest-first``: the built-in token-budget scheduler, ordered by prompt length instead of arrival."""

from __future__ import annotations

from typing import Any, ClassVar

from tokenmill import KVCacheManager, Request
from tokenmill.scheduler import FCFSScheduler
from tokenmill_example_policies.options import ExamplePoliciesOptions


class ShortestFirstScheduler(FCFSScheduler):
    """Admits (and keeps running, under memory pressure) the shortest prompts first; ties go by arrival.

    Everything else (chunked prefill, preemption, n > 1, aborts, stop checks) is ``FCFSScheduler``'s: a
    policy that only reorders requests overrides ``sort_key``. Long prompts can wait while short ones keep
    arriving; that is the trade this policy makes for lower median latency.
    """

    name: ClassVar[str] = "shortest-first"

    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        options: ExamplePoliciesOptions | None = None,
    ) -> None:
        super().__init__(kv_cache, max_num_batched_tokens, max_num_seqs)
        self.options = options or ExamplePoliciesOptions()

    def sort_key(self, request: Request) -> Any:
        # Fixed while the request is queued, and a total order (the id breaks the last ties).
        return (request.num_prompt_tokens, request.arrival_time, request.request_id)
