"""Sampling: which sampler plugin picks tokens, and which logits processors the engine builds."""

from __future__ import annotations

from typing import Annotated

import msgspec

from tokenmill.config.base import ConfigSection, describe


class SamplerConfig(ConfigSection, frozen=True):
    sampler: Annotated[
        str,
        describe("Sampler plugin by name: turns each step's logits into tokens ('torch' is built in)."),
    ] = "torch"
    logits_processors: Annotated[
        list[str],
        describe(
            "Logits processor plugins to build besides the built-in 'logit_bias' and 'min_tokens' (which implement "
            "those sampling parameters and always run, as in vLLM); each applies to the requests whose sampling "
            "parameters ask for it.",
            flag="--logits-processors",
        ),
    ] = msgspec.field(default_factory=list)
