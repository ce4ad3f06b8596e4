"""``Request``: one sequence's state inside the engine.

A request is a token sequence (prompt, then generated tokens) with a count of
how many of its tokens have K/V in the cache (``num_computed_tokens``). There
is no separate prefill or decode mode: each step the scheduler gives a
request some of its uncomputed tokens, and when a step computes its last
known token, a new token is sampled and appended.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.messages import TokenLogprobs
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.lora.manager import AdapterLoad
    from tokenmill.lora.request import LoRARequest
    from tokenmill.structured_output.request import StructuredOutputRequest

#: Stands in the token lists for a token that a step still running on the device is sampling (async
#: scheduling, docs/engine.md): the next step is scheduled before the value is known, and the model runner
#: takes that step's input id from the device instead. Never a real token id.
PLACEHOLDER_TOKEN_ID = -1


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again, its blocks freed; recomputes when readmitted
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    arrival_time: float
    priority: int = 0  # lower runs first (and is preempted last); ties go by arrival time
    cache_salt: str | None = None  # adapter/tenant: requests with different salts share no blocks
    parent_id: str | None = None  # for completions 1..n-1 of an n > 1 request: the request they fork from
    index: int = 0  # which of the n completions this is
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    #: With ``params.prompt_logprobs``: prompt tokens 1.. as their positions are computed.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    enqueued_at: float = 0.0  # engine clock (time.monotonic), when add_request queued it
    queue_time: float | None = None  # seconds from enqueued_at to its first scheduled step
    #: Draft tokens the speculator proposed after the last step, verified in the next one (speculative
    #: decoding); the scheduler's own: set by ``Scheduler.update_draft_token_ids``, trimmed or cleared by it.
    spec_token_ids: list[int] = field(default_factory=list)
    #: When those drafts form a tree (``tokenmill.speculative.draft_tree``): each one's parent; None for a chain.
    spec_parents: list[int] | None = None
    #: With ``params.structured_outputs``: its compile, then its grammar matcher (docs/structured_outputs.md).
    #: The request waits until it is ready; the scheduler advances it with each token the request keeps.
    structured_output: StructuredOutputRequest | None = None
    #: The LoRA adapter it runs with (None: the base model); its ``cache_salt`` already includes it.
    lora_request: LoRARequest | None = None
    #: With ``lora_request``, in an engine: its adapter's read into host memory (``tokenmill.lora.manager``); the
    #: request waits until it is ready, then holds the adapter's weights until it ends.
    lora_load: AdapterLoad | None = None
    #: Plugins and engine-side helpers keep per-request state here, never as new attributes.
    stash: dict[Any, Any] = field(default_factory=dict)
    #: Prompt then output tokens, extended in place by ``append_token``: the engine reads it every
    #: step, so it is kept rather than rebuilt. Read-only for everyone else.
    all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether the prompt's logprobs are asked for and not all computed yet (so no cached prefix serves)."""
        wanted = self.params.prompt_logprobs is not None and self.parent_id is None  # forks share completion 0's
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def sort_key(self) -> tuple[int, float, str]:
        """Scheduling order: priority, then arrival, then id (a total order, for determinism)."""
        return (self.priority, self.arrival_time, self.request_id)

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def append_placeholder(self) -> None:
        """Append ``PLACEHOLDER_TOKEN_ID`` for the token an in-flight step is sampling."""
        self.append_token(PLACEHOLDER_TOKEN_ID)

    def resolve_placeholder(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        """Replace the placeholder ``append_placeholder`` added last with the token the step sampled."""
        assert self.output_token_ids[-1] == PLACEHOLDER_TOKEN_ID, "no placeholder to resolve"
        self.output_token_ids[-1] = self.all_token_ids[-1] = token_id
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def drop_placeholder(self) -> None:
        """Remove the placeholder ``append_placeholder`` added last (its step failed the request)."""
        assert self.output_token_ids[-1] == PLACEHOLDER_TOKEN_ID, "no placeholder to drop"
        self.output_token_ids.pop()
        self.all_token_ids.pop()

    def check_stop(self) -> RequestStatus | None:
        """The finished status the last appended token causes, if any (token-level stops only;
        stop strings are matched on text by the output processor)."""
        params = self.params
        num_output = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if num_output >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
