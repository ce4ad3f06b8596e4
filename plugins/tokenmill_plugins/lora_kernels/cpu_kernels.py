"""The ``cpu`` LoRA kernels: one C++ call per adapted linear (``tokenmill_kernels.lora.cpu``, AVX2), float32
activations, adapter weights in float32, float16 or bfloat16 (``--lora-dtype``).

The torch reference costs a few dispatches per adapter in the step, per linear: at one token, or a few tokens per
adapter, they are most of the time an adapter adds to a step (docs/benchmarks.md, "LoRA adapters (issue 40)").
``auto`` picks these on a CPU that can build and run them (AVX2, FMA, a C++ compiler and ninja). Activations in
other dtypes than float32, and inputs that need gradients, go to the torch reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from tokenmill_kernels.lora import cpu as kernels

from tokenmill.lora.kernels import LoRABatch, TorchLoRAKernels

_WEIGHTS = (torch.float32, torch.float16, torch.bfloat16)


class CpuLoRAKernels(TorchLoRAKernels):
    name: ClassVar[str] = "cpu"
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu",)
    #: Above ``torch`` (0).
    auto_priority: ClassVar[int] = 5

    @classmethod
    def is_available(cls) -> bool:
        return kernels.is_available()

    def __init__(self) -> None:
        kernels.prepare()  # build (first run on a machine) or load beside the weights

    def add_lora(
        self,
        batch: LoRABatch,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: Sequence[torch.Tensor],
        offsets: Sequence[int],
        y: torch.Tensor,
    ) -> None:
        if x.dtype != torch.float32 or y.dtype != torch.float32 or lora_a.dtype not in _WEIGHTS or x.requires_grad:
            return super().add_lora(batch, x, lora_a, lora_b, offsets, y)
        if x.stride(-1) != 1:
            x = x.contiguous()
        kernels.add_lora(x, lora_a, lora_b, offsets, batch.token_slots, y)
