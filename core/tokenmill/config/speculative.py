"""Speculative decoding: which speculator drafts tokens, how many, and when to stop drafting.

The table is vLLM's ``--speculative-config`` (the same JSON keys), so a command
line moves over unchanged::

    tokenmill serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

``method`` names a speculator plugin (slot ``speculator``); the other keys are
read by the built-in speculators, and a third-party speculator takes its own
options from ``[plugins.NAME]``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from tokenmill.config.base import ConfigSection, NonNegativeInt, PositiveInt, describe
from tokenmill.speculative.draft_tree import parse_token_tree

#: Built-in methods that load a second set of weights from ``model``.
_NEEDS_MODEL = ("draft_model", "medusa")


class SpeculativeConfig(ConfigSection, frozen=True):
    method: Annotated[
        str | None,
        describe(
            "Speculator plugin by name, or unset for no speculation. Built in: 'ngram' (prompt lookup), "
            "'draft_model' (a smaller or quantized model), 'medusa' (Medusa heads)."
        ),
    ] = None
    num_speculative_tokens: Annotated[
        PositiveInt | None,
        describe("Draft tokens per request per step (k); unset takes the speculator's default."),
    ] = None
    model: Annotated[
        str | None,
        describe(
            "'draft_model': the draft model (a directory, GGUF file or registry name, loaded like model.model). "
            "'medusa': the directory of Medusa heads (config.json and medusa_lm_head.safetensors)."
        ),
    ] = None
    quantization: Annotated[
        str | None,
        describe(
            "'draft_model': the draft's quantizer, like model.quantization (unset: 'auto'). "
            "'medusa': the quantizer of the heads' own weights, 'int8', 'int4' or 'none' (unset: 'int8' for a "
            "float32 target on a CPU, else 'none')."
        ),
    ] = None
    prompt_lookup_min: Annotated[
        PositiveInt | None,
        describe("'ngram': the shortest n-gram to match (unset: 3)."),
    ] = None
    prompt_lookup_max: Annotated[
        PositiveInt | None,
        describe("'ngram': the longest n-gram to match, tried first (unset: 5)."),
    ] = None
    speculative_token_tree: Annotated[
        str | None,
        describe(
            "A tree of drafts to verify per step instead of a chain (vLLM's key): each node as the path of candidate "
            "ranks from the request's last token, e.g. '[(0,), (1,), (0, 0)]' for the top-1 and top-2 candidates "
            "and the top-1 after the top-1; parents before children, at most 64 nodes. For speculators that draft "
            "trees ('medusa'); num_speculative_tokens, when set, must equal the number of nodes. Unset: 'medusa' "
            "uses the tree stored with its heads, if any."
        ),
    ] = None
    draft_policy: Annotated[
        Literal["goodput", "constant"],
        describe(
            "How many drafts each request verifies per step. 'goodput': the counts that maximise expected tokens "
            "per second, from the measured step cost and each request's measured acceptance (none at all when "
            "drafting does not pay, as at large batches; `tokenmill.speculative.draft_policy`). 'constant': always "
            "num_speculative_tokens."
        ),
    ] = "goodput"
    disable_by_batch_size: Annotated[
        NonNegativeInt,
        describe(
            "Draft nothing in a step where at least this many requests are running (vLLM's hard cap, on top of "
            "draft_policy). 0: no cap."
        ),
    ] = 0

    def __post_init__(self) -> None:
        if self.method is None:
            defaults = ("disable_by_batch_size", "draft_policy")
            set_keys = [k for k in self.__struct_fields__ if k not in defaults and getattr(self, k)]
            if set_keys:
                raise ValueError(f"{set_keys[0]} is set but method is not; set method to speculate")
            return
        if self.method in _NEEDS_MODEL and not self.model:
            raise ValueError(f"method {self.method!r} needs model: the path of its weights")
        if self.method not in _NEEDS_MODEL and self.model is not None:
            raise ValueError(f"model is not used by method {self.method!r}")
        if self.method not in ("draft_model", "medusa") and self.quantization is not None:
            raise ValueError(f"quantization is only used by methods 'draft_model' and 'medusa', not {self.method!r}")
        lookup = self.prompt_lookup_min is not None or self.prompt_lookup_max is not None
        if lookup and self.method != "ngram":
            raise ValueError(f"prompt_lookup_min/max are only used by method 'ngram', not {self.method!r}")
        if self.speculative_token_tree is not None:
            tree = parse_token_tree(self.speculative_token_tree)
            k = self.num_speculative_tokens
            if k is not None and k != len(tree):
                raise ValueError(f"num_speculative_tokens={k}, but speculative_token_tree has {len(tree)} nodes: "
                                 "leave num_speculative_tokens unset or set it to the number of nodes")  # fmt: skip
        low, high = self.prompt_lookup_min or 3, self.prompt_lookup_max or max(5, self.prompt_lookup_min or 3)
        if low > high:
            raise ValueError(f"prompt_lookup_min={low} is larger than prompt_lookup_max={high}")
