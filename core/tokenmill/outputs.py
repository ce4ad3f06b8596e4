"""What the offline API returns, shaped like the objects vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    logprob: float
    decoded_token: str


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    #: Per generated token: {token_id: Logprob} for the sampled token and the top alternatives.
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if any

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return bool(self.outputs) and all(o.finished for o in self.outputs)
