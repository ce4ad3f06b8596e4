"""The logits processor interface, and the built-in ``logit_bias`` and ``min_tokens`` processors.

A logits processor changes the logits of the requests that ask for it, before
sampling. The engine builds the processors named in ``sampler.logits_processors``
once; each step, every processor sees the rows for which its ``is_active`` is
true and changes them in one batched call. A request asks for a processor
through its sampling parameters: a built-in field (``logit_bias``,
``min_tokens``) or, for a plugin, a key of ``SamplingParams.extra_args``
(``vllm_xargs`` over HTTP).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from tokenmill.device_copy import to_device
from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """What a logits processor may read about one request this step. Lists are the request's own: read them,
    never change them."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...]


class LogitsProcessor(ABC):
    """Changes the logits of the requests that ask for it, once per step, before penalties and sampling.

    Built once per engine process with no arguments (plus ``options=`` when its plugin declares options).
    Both methods run in the engine process, from the engine loop, and must not block or call hooks.
    An exception fails only the requests the processor applied to that step, with an error naming it;
    the engine keeps serving. ``tokenmill.testing.check_logits_processor`` checks the contract.
    """

    #: Registered name.
    name: ClassVar[str]
    #: Whether ``is_active`` or ``apply`` reads the values of a row's ``output_token_ids`` (their number aside).
    #: A step in which a processor that does is active is never scheduled ahead of the step before (async
    #: scheduling): that step's token is still a placeholder there.
    reads_output_token_ids: ClassVar[bool] = True

    @abstractmethod
    def is_active(self, row: SamplingRow) -> bool:
        """Whether this processor changes ``row``'s logits this step. Called once per sampling row per step,
        so it must be cheap (look at ``row.params``)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: list[int], states: list[SamplingRow]) -> torch.Tensor:
        """Change ``logits[rows[i]]`` for the request ``states[i]`` and return the logits.

        :param logits: [R, vocab_size] float32, the step's logits after earlier processors; this call may
            change it in place. Rows not in ``rows`` must be left as they are.
        """


class LogitBiasLogitsProcessor(LogitsProcessor):
    """OpenAI ``logit_bias``: adds each request's bias (-100..100) to the logits of the tokens it names."""

    name: ClassVar[str] = "logit_bias"
    reads_output_token_ids: ClassVar[bool] = False

    def is_active(self, row: SamplingRow) -> bool:
        return bool(row.params.logit_bias)

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[SamplingRow]) -> torch.Tensor:
        row_index: list[int] = []
        token_ids: list[int] = []
        biases: list[float] = []
        for row, state in zip(rows, states, strict=True):
            assert state.params.logit_bias is not None
            for token_id, bias in state.params.logit_bias.items():
                row_index.append(row)
                token_ids.append(token_id)
                biases.append(bias)
        index = (to_device(row_index, logits.device), to_device(token_ids, logits.device))
        values = to_device(biases, logits.device, logits.dtype)  # [num_biases]
        return logits.index_put_(index, values, accumulate=True)


class MinTokensLogitsProcessor(LogitsProcessor):
    """``min_tokens``: EOS and the request's stop token ids cannot be sampled until it has that many tokens."""

    name: ClassVar[str] = "min_tokens"
    reads_output_token_ids: ClassVar[bool] = False  # only how many there are

    def is_active(self, row: SamplingRow) -> bool:
        return len(row.output_token_ids) < row.params.min_tokens and bool(
            row.eos_token_ids or row.params.stop_token_ids
        )

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[SamplingRow]) -> torch.Tensor:
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for row, state in zip(rows, states, strict=True):
            token_ids = {*state.eos_token_ids, *state.params.stop_token_ids}
            banned_rows += [row] * len(token_ids)
            banned_ids += token_ids
        logits[to_device(banned_rows, logits.device), to_device(banned_ids, logits.device)] = float("-inf")
        return logits
