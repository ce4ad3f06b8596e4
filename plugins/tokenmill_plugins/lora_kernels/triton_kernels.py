"""The ``triton`` LoRA kernels: every adapted linear's shrink and expand in two Triton launches on a GPU
(``tokenmill_kernels.lora.triton``: Punica's BGMV, one program per token).

The torch reference costs a gather, a matmul per part and an ``index_add_`` per adapter in the step, per linear;
these cost two launches whatever the adapters (for three parts or fewer), and read each token's slot on the
device, so a CUDA graph can hold them. ``auto`` picks them on CUDA. Triton is a GPU extra: the kernels are imported
when the plugin is built, so this module imports, and ``auto`` passes it over, on a CPU install without Triton. On
CPU they run only under the Triton interpreter, built directly (for tests). Activations, adapters (``--lora-dtype``:
they may be narrower) and outputs in float32, float16 or bfloat16 are summed in float32; other dtypes, and inputs
that need gradients, go to the torch reference.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import ClassVar

import torch

from tokenmill.lora.kernels import LoRABatch, TorchLoRAKernels
from tokenmill_plugins.triton_import import load_gpu_kernels


class TritonLoRAKernels(TorchLoRAKernels):
    name: ClassVar[str] = "triton"
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    #: Above ``torch`` (0).
    auto_priority: ClassVar[int] = 5

    @classmethod
    def is_available(cls) -> bool:
        """A CUDA device is visible and Triton is installed (the CPU interpreter is for tests only)."""
        return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None

    def __init__(self) -> None:
        self._kernels = load_gpu_kernels(
            "tokenmill_kernels.lora.triton", "the lora_kernel 'triton'", "select --lora-kernels cpu or torch"
        )

    def add_lora(
        self,
        batch: LoRABatch,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: Sequence[torch.Tensor],
        offsets: Sequence[int],
        y: torch.Tensor,
    ) -> None:
        if not {x.dtype, lora_a.dtype, y.dtype} <= set(self._kernels.SUPPORTED_DTYPES) or x.requires_grad:
            return super().add_lora(batch, x, lora_a, lora_b, offsets, y)
        self._kernels.add_lora(x, lora_a, lora_b, offsets, batch.token_slots, y)
