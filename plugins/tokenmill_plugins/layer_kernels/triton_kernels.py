"""The ``triton`` layer kernels: each operation between a layer's matmuls in one Triton kernel.

On a GPU a Llama layer's norms, residual adds, rope and SiLU times up take 5 launches instead of about 21
(``tokenmill_kernels.layer_kernels.triton``). ``auto`` picks them on CUDA. On CPU they run only under the
Triton interpreter, by name (slow: for tests). Triton is a GPU extra: the kernels are imported when the
plugin is built, so this module imports, and ``auto`` passes it over, on a CPU install without Triton.
"""

from __future__ import annotations

import importlib.util
from typing import ClassVar

import torch

from tokenmill.interfaces import LayerKernels
from tokenmill_plugins.triton_import import load_gpu_kernels


class TritonLayerKernels(LayerKernels):
    name: ClassVar[str] = "triton"
    #: "cpu" only under TRITON_INTERPRET=1 (checked at construction).
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda", "cpu")
    #: Above ``torch`` (0); ``auto_selectable`` holds on CUDA only.
    auto_priority: ClassVar[int] = 10

    @classmethod
    def is_available(cls) -> bool:
        """A CUDA device is visible and Triton is installed (the CPU interpreter is opt-in, by name)."""
        return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None

    @classmethod
    def auto_selectable(cls, device: torch.device) -> bool:
        return device.type == "cuda" and cls.is_available()

    def __init__(self) -> None:
        self._kernels = load_gpu_kernels(
            "tokenmill_kernels.layer_kernels.triton", "the layer_kernel 'triton'", "select --layer-kernels torch"
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._kernels.rms_norm(x, weight, eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kernels.rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._kernels.silu_and_mul(gate_up)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._kernels.rotary(x, cos, sin)
