"""The ``cpu`` LoRA kernels: one C++ call per adapted linear (``tokenmill_kernels.lora.cpu``, AVX2), float32
activations, adapter weights in float32, float16 or bfloat16 (``--lora-dtype``).

The torch reference costs a few dispatches per adapter in the step, per linear: at one token, or a few tokens per
adapter, they are most of the time an adapter adds to a step (docs/benchmarks.md, "LoRA adapters (issue 40)").
So does any per-call work beyond the product: ``prepare`` groups the step's tokens by slot once (a native plan
the batch carries), ``bind`` checks each linear's slot tensors once, and each call checks only its input and
output. ``auto`` picks these on a CPU that can build and run them (AVX2, FMA, a C++ compiler and ninja).
Activations in other dtypes than float32, and inputs that need gradients, go to the torch reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy
import torch
from tokenmill_kernels.lora import cpu as kernels

from tokenmill.lora.kernels import BoundLoRA, LoRABatch, TorchLoRAKernels

_WEIGHTS = (torch.float32, torch.float16, torch.bfloat16)
_FLOAT32 = torch.float32


@dataclass(frozen=True)
class CpuLoRABatch(LoRABatch):
    """A ``LoRABatch`` with the step's tokens grouped by slot for the C++ kernel."""

    plan: Any = None


class BoundCpuLoRA:
    """One adapted linear's ``add(batch, x, y)`` through the C++ kernel, over the slots ``weights`` checked (the
    extension's ``Weights``, which the ``cpu`` layer kernels' decoder stack also calls from C++); inputs the kernel
    does not take go to the torch reference."""

    __slots__ = ("_add", "_reference", "weights")

    def __init__(self, weights: Any, reference: BoundLoRA) -> None:
        self.weights = weights
        self._add = weights.add
        self._reference = reference

    def __call__(self, batch: LoRABatch, x: torch.Tensor, y: torch.Tensor) -> None:
        plan = getattr(batch, "plan", None)
        if plan is None or x.dtype is not _FLOAT32 or y.dtype is not _FLOAT32 or x.requires_grad:
            return self._reference(batch, x, y)
        self._add(plan, x if x.stride(-1) == 1 else x.contiguous(), y)


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

    def prepare(self, token_slots: numpy.ndarray, device: torch.device) -> LoRABatch:
        batch = super().prepare(token_slots, device)
        if batch.token_slots.device.type != "cpu":
            return batch
        return CpuLoRABatch(batch.num_tokens, batch.token_slots, batch.groups, kernels.plan(batch.token_slots))

    def bind(self, lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor], offsets: Sequence[int]) -> BoundLoRA:
        reference = super().bind(lora_a, lora_b, offsets)
        if lora_a.dtype not in _WEIGHTS or lora_a.device.type != "cpu":
            return reference
        return BoundCpuLoRA(kernels.weights(lora_a, lora_b, offsets), reference)

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
        plan = batch.plan if isinstance(batch, CpuLoRABatch) else kernels.plan(batch.token_slots)
        kernels.weights(lora_a, lora_b, offsets).add(plan, x, y)
