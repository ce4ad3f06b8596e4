"""What the offline API returns, shaped like the objects vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    logprob: float
    decoded_token: str
    rank: int | None = None  # 1: the most likely token; set for prompt tokens (vLLM's prompt_logprobs)


@dataclass
class TextToken:
    """A generated token as it appears in the returned text, with its logprobs.

    ``text`` is what the token adds to the text: the tokens of one multi-byte
    character add "" until the one that completes it, which adds the whole
    character; the token cut by a stop string adds only what precedes the stop.
    Tokens whose text is not returned (EOS, stop token ids, anything after a stop
    string) have no TextToken, so the ``text`` of a completion's TextTokens
    concatenate to exactly its text.
    """

    token_id: int
    text: str
    logprobs: dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    #: Per generated token: {token_id: Logprob} for the sampled token and the top alternatives.
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if any
    #: With logprobs: the tokens whose text is in ``text`` (the API's logprobs cover exactly these).
    text_tokens: list[TextToken] | None = None

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
    #: With ``prompt_logprobs``: per prompt token, None for the first (nothing precedes it), then
    #: {token_id: Logprob} for the prompt token (with its rank) and its top alternatives.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    #: Every completion has finished: all n of them (the output processor sets it; a completion that ends
    #: while its siblings' outputs are still on their way leaves it False), or fewer when the request was
    #: aborted before it forked.
    finished: bool = False
