"""The ``cpu`` layer kernels: RMSNorm with the residual add, rope, and SiLU times up, in one C++ pass each (AVX2,
float32), and the dense float32 matmul of the ``none`` quantizer's weights (``tokenmill_kernels.dense_matmul``).

At one token a Llama layer's norms, rope and activation cost their dispatches in torch operators, not their work
(docs/benchmarks-history.md, "Layer kernels on the CPU: C++ against torch operators"). ``auto`` picks these on a CPU
that can build and run them (AVX2, FMA, a C++ compiler and ninja, as the ``cpu`` attention backend). Other dtypes
than float32, and inputs that need gradients (the C++ has no backward), go to the torch reference.

The dense matmul packs each float32 weight into panels of 32 outputs and reads it once for up to 12 input rows
(3 with AVX2 alone), so a few rows cost what one does, where oneDNN's packed linear, which it replaces by default,
grows with the rows (docs/benchmarks-history.md, "Dense float32 linears: the cpu layer kernels against oneDNN");
``TOKENMILL_DENSE_CPU_MATMUL=onednn`` goes back to oneDNN.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from tokenmill_kernels.dense_matmul import cpu as dense_matmul
from tokenmill_kernels.layer_kernels import cpu as kernels
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.layers.kernels import FusedDecoder, TorchLayerKernels


class CpuLayerKernels(TorchLayerKernels):
    name: ClassVar[str] = "cpu"
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu",)
    #: Above ``torch`` (0); on a GPU ``auto_selectable`` is false.
    auto_priority: ClassVar[int] = 5

    @classmethod
    def is_available(cls) -> bool:
        return kernels.is_available() and dense_matmul.is_available()

    def __init__(self) -> None:
        # Start building (first run on a machine) or loading the C++ now, beside the weights. The dense matmul
        # builds when a model first packs a float32 weight: the quantized default model never does.
        kernels.prepare()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _runs(x):
            return super().rms_norm(x, weight, eps)
        return kernels.rms_norm(x, weight, eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not _runs(x, residual):
            return super().add_rms_norm(x, residual, weight, eps)
        normed, total = kernels.rms_norm(x, weight, eps, residual)
        assert total is not None
        return normed, total

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not _runs(gate_up):
            return super().silu_and_mul(gate_up)
        return kernels.silu_and_mul(gate_up)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not _runs(x):
            return super().rotary(x, cos, sin)
        return kernels.rotary(x, cos, sin)

    def fused_decoder(self, model: nn.Module, attention: AttentionBackend) -> FusedDecoder | None:
        from tokenmill_plugins.layer_kernels.cpu_decoder import fused_decoder

        return fused_decoder(model, attention, self)

    def pack_dense_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        if not (weight.is_cpu and weight.dtype == torch.float32):
            return None
        return dense_matmul.pack(weight)

    def dense_linear(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return dense_matmul.linear(x, packed, out_features, bias)


def _runs(x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether the C++ takes these inputs: float32 on the CPU, without gradients. Plain attribute reads: this runs
    three times a layer."""
    if residual is not None and residual.requires_grad:
        return False
    return x.is_cpu and x.dtype == torch.float32 and not x.requires_grad
