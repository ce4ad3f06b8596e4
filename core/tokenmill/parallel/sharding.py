"""Whether a model can be split into ``tensor_parallel_size`` shards: checked before anything loads."""

from __future__ import annotations

import os

import torch

from tokenmill.errors import TokenmillError
from tokenmill.layers.quantizer import Quantizer
from tokenmill.models.architecture import ArchitectureConfig


class TensorParallelError(TokenmillError, ValueError):
    """A model or setting that cannot run split over shards, or a shard that died; one line, naming the number."""


def check_shardable(
    arch: ArchitectureConfig, size: int, model_class: type, quantizer: Quantizer, device: torch.device
) -> None:
    """Raise ``TensorParallelError`` (one line) when ``size`` shards cannot hold this model: a count it does
    not divide, an architecture or quantizer that cannot be split, or too few GPUs."""
    setting = f"parallel.tensor_parallel_size={size}"
    if not getattr(model_class, "supports_tensor_parallel", False):
        raise TensorParallelError(f"{setting}: architecture {arch.architecture} cannot be split over shards")
    counts = [
        ("attention heads", arch.num_attention_heads),
        ("KV heads", arch.num_kv_heads),
        ("intermediate size", arch.intermediate_size),
        ("vocabulary size", arch.vocab_size),
    ]
    for what, count in counts:
        if count % size:
            raise TensorParallelError(
                f"{setting}: the model's {count} {what} do not split into {size} equal shards; "
                f"choose a tensor_parallel_size that divides {count}"
            )
    if quantizer.checkpoint_tensor_names != ("weight",):
        raise TensorParallelError(
            f"{setting}: quantizer {quantizer.name!r} reads a checkpoint quantized by another tool, which "
            "tokenmill does not split over shards; use tensor_parallel_size = 1"
        )
    group = quantizer.input_group_size
    # Row-parallel layers (o_proj, down_proj) split their input; every shard must hold whole quant groups.
    for what, num_inputs in (
        ("o_proj", arch.num_attention_heads * arch.head_dim),
        ("down_proj", arch.intermediate_size),
    ):
        if (num_inputs // size) % group:
            raise TensorParallelError(
                f"{setting}: {what}'s {num_inputs} inputs give each shard {num_inputs // size}, not whole blocks "
                f"of {group} for quantizer {quantizer.name!r}; choose another tensor_parallel_size or "
                "model.quantization = 'none'"
            )
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise TensorParallelError(f"{setting}: one GPU per shard is needed and torch sees {torch.cuda.device_count()}")


def shard_num_threads(size: int) -> int:
    """Torch threads for one of ``size`` CPU shards sharing this machine: an equal share of the cores this
    process may run on."""
    return max(1, len(os.sched_getaffinity(0)) // size)
