"""``SamplingParams``: how one request's tokens are chosen and when it stops.

A msgspec struct, because it travels with the request to the engine process.
Field names and defaults follow what users know from vLLM and OpenAI.
"""

from __future__ import annotations

import json as _json
from typing import Any

import msgspec

from tokenmill.errors import TokenmillError


class InvalidRequestError(TokenmillError, ValueError):
    """A request's parameters are invalid; the message names the parameter and the allowed range."""


#: The kinds of constraint ``StructuredOutputsParams`` holds, in the order its fields are checked.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A constraint on a request's output (vLLM's ``StructuredOutputsParams``): exactly one of ``json``,
    ``regex``, ``choice``, ``grammar`` or ``json_object``. The engine's structured-output backend
    (``structured_outputs_config.backend``) compiles it once, cached by its text, and masks every step's
    logits so that only tokens the constraint allows can be sampled; the request ends when it is complete."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (an object, or its text): the output is a JSON value valid against it."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar: Lark syntax (llguidance; GBNF is converted) or EBNF/GBNF (xgrammar)."""
    json_object: bool | None = None
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    disable_any_whitespace: bool = False
    """JSON without whitespace between its tokens (as ``json.dumps(separators=(",", ":"))`` writes it)."""
    disable_additional_properties: bool = False
    """A JSON schema's objects take no properties beyond those listed, unless it says otherwise."""

    def __post_init__(self) -> None:
        given = [kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            found = ", ".join(given) if given else "none"
            raise InvalidRequestError(
                f"structured_outputs={self!r} is invalid: must set exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)} (got {found})"
            )
        if self.choice is not None and not self.choice:
            raise InvalidRequestError("structured_outputs.choice=[] is invalid: must list at least one string")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``STRUCTURED_OUTPUT_KINDS``."""
        return next(kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text (a schema or a choice list as compact JSON with sorted keys): with ``kind``
        and the two flags, the key its compiled grammar is cached by."""
        kind = self.kind
        if kind == "json_object":
            return ""
        value = getattr(self, kind)
        if isinstance(value, str) and kind != "choice":
            return value
        return _json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    n: int = 1
    """Completions to generate for the prompt; they share the prompt's KV blocks."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability sums to at least top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) keeps all."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely token."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens seen in prompt or output; 1 is off."""
    presence_penalty: float = 0.0
    """Subtract from logits of tokens that already appear in the output."""
    frequency_penalty: float = 0.0
    """Subtract, per occurrence in the output so far, from a token's logit."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the context window."""
    min_tokens: int = 0
    """Tokens to generate before EOS or stop token ids may end the request."""
    stop: list[str] = msgspec.field(default_factory=list)
    """Strings that end generation; they are not included in the output text."""
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    """Token ids that end generation (in addition to EOS)."""
    ignore_eos: bool = False
    """Keep generating after EOS (for benchmarks)."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives (0: only the sampled token)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before sampling, each in [-100, 100] (OpenAI's ``logit_bias``)."""
    extra_args: dict[str, Any] | None = None
    """Arguments for logits processor plugins, by key (``vllm_xargs`` over HTTP, as in vLLM)."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob (and rank) under the model, with this many top alternatives (vLLM's
    ``prompt_logprobs``). The prompt is then computed in full: its cached prefix is not reused."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar (vLLM's field;
    docs/structured_outputs.md)."""

    def __post_init__(self) -> None:
        checks = [
            (self.n >= 1, "n", self.n, "at least 1"),
            (self.temperature >= 0, "temperature", self.temperature, "at least 0"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]"),
            (self.top_k >= -1, "top_k", self.top_k, "-1, 0 (off) or a positive count"),
            (0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "greater than 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens, "at least 1"),
            (self.min_tokens >= 0, "min_tokens", self.min_tokens, "at least 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs, "from 0 to 20"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs",
                self.prompt_logprobs,
                "from 0 to 20",
            ),
            (all(s for s in self.stop), "stop", self.stop, "non-empty strings"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids, "token ids >= 0"),
            (
                not self.logit_bias or all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias.items()),
                "logit_bias",
                self.logit_bias,
                "token ids >= 0 mapped to biases in [-100, 100]",
            ),
        ]
        for ok, name, value, allowed in checks:
            if not ok:
                raise InvalidRequestError(f"{name}={value!r} is invalid: must be {allowed}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens={self.min_tokens} is invalid: must not exceed max_tokens={self.max_tokens}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
