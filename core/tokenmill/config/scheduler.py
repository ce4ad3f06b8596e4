"""Continuous batching: limits, and which scheduler plugin decides each step."""

from __future__ import annotations

from typing import Annotated

from tokenmill.config.base import ConfigSection, PositiveInt, describe


class SchedulerConfig(ConfigSection, frozen=True):
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
    policy: Annotated[
        str,
        describe(
            "Scheduler plugin by name. 'fcfs' runs requests in arrival order; 'priority' runs the lowest "
            "request `priority` value first (ties by arrival) and preempts the highest last. A request that sets "
            "a priority under 'fcfs' is refused, as in vLLM.",
            flag="--scheduling-policy",
        ),
    ] = "fcfs"
    async_scheduling: Annotated[
        bool,
        describe(
            "Schedule and launch each decode step while the step before still runs on the GPU, reading its "
            "input ids there, so the GPU does not wait for the host between steps (as vLLM's "
            "--async-scheduling). Off by default, as in vLLM: each step's outputs are reported after the next "
            "step is launched (docs/engine.md). Ignored, with a warning, with speculative decoding, KV tiers or tensor "
            "parallelism; steps with penalties or prompt logprobs run in order. On the CPU it runs but gains "
            "nothing: the model computes on the scheduler's own cores."
        ),
    ] = False
