"""Every message that crosses a process boundary, and nothing else.

``array_like`` makes field order the wire format: add new fields at the end
with defaults, never reorder, and bump ``PROTOCOL_VERSION`` for a breaking change.
"""

from __future__ import annotations

import msgspec

from tokenmill.sampling_params import SamplingParams

PROTOCOL_VERSION = 1


class TokenLogprobs(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The sampled token's logprob and the most likely alternatives at that position."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """A new request, sent once from the front end to the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request: only the new tokens (a delta)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    parent_id: str | None = None  # set on completions 1..n-1 of an n > 1 request
    index: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
