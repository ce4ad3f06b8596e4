"""Continuous batching limits."""

from __future__ import annotations

from typing import Annotated

from tokenmill.config.base import ConfigSection, PositiveInt, describe


class SchedulerConfig(ConfigSection):
    max_num_batched_tokens: Annotated[
        PositiveInt,
        describe(
            "Token budget of one engine step, shared by decode tokens (one per running request) and "
            "prompt chunks; longer prompts are read over several steps (chunked prefill)."
        ),
    ] = 2048
    max_num_seqs: Annotated[
        PositiveInt,
        describe("Most requests running at once (each completion of n > 1 counts)."),
    ] = 256
