"""Whether a model can be split into ``tensor_parallel_size`` shards: checked before anything loads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.errors import TokenmillError
from tokenmill.layers.quantizer import Quantizer
from tokenmill.models.architecture import ArchitectureConfig

if TYPE_CHECKING:
    from tokenmill.models.base import CausalLM


class TensorParallelError(TokenmillError, ValueError):
    """A model or setting that cannot run split over shards, or a shard that died; one line, naming the number."""


@dataclass(frozen=True)
class SplitInput:
    """A feed-forward block's row-parallel input width, split over the shards: an architecture's
    ``CausalLM.tensor_parallel_inputs`` lists them for ``check_shardable``."""

    what: str  # in "the model's 30 {what} do not split into 4 equal shards"
    layer: str  # in "{layer}'s 32 inputs give each shard 16, not whole blocks of 32"
    num_inputs: int
    hint: str = ""  # another way out than those the errors name, appended to them ("or ...")


def check_shardable(
    arch: ArchitectureConfig,
    size: int,
    model_class: type[CausalLM],
    quantizer: Quantizer,
    device: torch.device,
    expert_parallel: bool = False,
) -> None:
    """Raise ``TensorParallelError`` (one line) when ``size`` shards cannot hold this model: a count it does
    not divide, an architecture or quantizer that cannot be split, or too few GPUs. ``expert_parallel``:
    experts are split whole (``parallel.enable_expert_parallel``), so their inner width is not."""
    setting = f"parallel.tensor_parallel_size={size}"
    if not getattr(model_class, "supports_tensor_parallel", False):
        raise TensorParallelError(
            f"{setting}: architecture {arch.architecture} cannot be split over shards: {model_class.__name__} "
            "builds every layer whole (no supports_tensor_parallel); use tensor_parallel_size = 1"
        )
    feed_forward = model_class.tensor_parallel_inputs(arch, expert_parallel)
    counts = [
        ("attention heads", arch.num_attention_heads, ""),
        ("KV heads", arch.num_kv_heads, ""),
        ("vocabulary size", arch.vocab_size, ""),
        *((split.what, split.num_inputs, split.hint) for split in feed_forward),
    ]
    for what, count, hint in counts:
        if count % size:
            raise TensorParallelError(
                f"{setting}: the model's {count} {what} do not split into {size} equal shards; "
                f"choose a tensor_parallel_size that divides {count}{hint}"
            )
    group = quantizer.input_group_size
    # Row-parallel layers (o_proj, down_proj) split their input; every shard must hold whole quant groups.
    for what, num_inputs, hint in (
        ("o_proj", arch.num_attention_heads * arch.head_dim, ""),
        *((split.layer, split.num_inputs, split.hint) for split in feed_forward),
    ):
        if (num_inputs // size) % group:
            raise TensorParallelError(
                f"{setting}: {what}'s {num_inputs} inputs give each shard {num_inputs // size}, not whole blocks "
                f"of {group} for quantizer {quantizer.name!r}; choose another tensor_parallel_size or "
                f"model.quantization = 'none'{hint}"
            )
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise TensorParallelError(f"{setting}: one GPU per shard is needed and torch sees {torch.cuda.device_count()}")


def shard_num_threads(size: int) -> int:
    """Torch threads for one of ``size`` CPU shards sharing this machine: an equal share of the cores this
    process may run on."""
    return max(1, len(os.sched_getaffinity(0)) // size)
