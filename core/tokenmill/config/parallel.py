"""How one replica's model is split over processes (tensor parallelism, and expert parallelism inside it)."""

from __future__ import annotations

from typing import Annotated

from tokenmill.config.base import ConfigSection, PositiveInt, describe


class ParallelConfig(ConfigSection, frozen=True):
    tensor_parallel_size: Annotated[
        PositiveInt,
        describe(
            "Shards of the model inside one replica, each in its own process over torch.distributed (gloo on "
            "CPU, NCCL on GPU): attention heads, KV heads, the MLP (each expert's, in a mixture of experts) and the "
            "vocabulary are split N ways. The model's heads, KV heads, intermediate sizes and vocabulary must "
            "divide by it (docs/serving.md#tensor-parallelism)."
        ),
    ] = 1
    enable_expert_parallel: Annotated[
        bool,
        describe(
            "Mixture-of-experts layers split their experts over the tensor_parallel_size shards (each shard holds "
            "whole experts, every N-th one) instead of a slice of every expert; attention, shared experts and "
            "dense layers stay tensor-parallel. No effect on dense models or at tensor_parallel_size = 1 "
            "(vLLM's flag; docs/serving.md#expert-parallelism)."
        ),
    ] = False
