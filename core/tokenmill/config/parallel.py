"""How one replica's model is split over processes (tensor parallelism)."""

from __future__ import annotations

from typing import Annotated

from tokenmill.config.base import ConfigSection, PositiveInt, describe


class ParallelConfig(ConfigSection, frozen=True):
    tensor_parallel_size: Annotated[
        PositiveInt,
        describe(
            "Shards of the model inside one replica, each in its own process over torch.distributed (gloo on "
            "CPU, NCCL on GPU): attention heads, KV heads, the MLP and the vocabulary are split N ways. The "
            "model's heads, KV heads, intermediate size and vocabulary must divide by it "
            "(docs/serving.md#tensor-parallelism)."
        ),
    ] = 1
