"""Weight-only quantization: 8-bit and 4-bit weights in groups of 32, float32 activations in and out.

``Int8Quantizer`` stores each group of 32 weights of a row as int8 with one float16 scale (GGUF's
Q8_0: 8.5 bits per weight); ``Int4Quantizer`` as 4-bit codes with a float16 scale and minimum
(GGUF's Q4_1: 5 bits per weight). Quantizing weights that a Q8_0 or Q4_1 file held reproduces them
exactly, so the default GGUF model runs from the weights in its file, not from a float32 copy. A
weight too large for float16 scales (int8: above about 8.3e6; int4: a group min beyond 65504 in
magnitude) fails to load with a ``ValueError``.

The quantized kernels round each input row to int16 per group of 32 and multiply in integers
(tokenmill_kernels.quant_matmul.reference gives the exact numerics): on the default model that
stays within 0.006 nats of float32 on the same weights, which int8 activations (llama.cpp's
Q8_1) do not (docs/performance.md, "Accuracy of the quantized path"). They run for any number of
rows, in passes of at most 128. Whether float32 GEMM on the dequantized weights beats them at many rows
depends on the CPU: on the AMD machine of docs/performance.md they won up to 1,024-row prompt chunks,
on an Intel Xeon with AVX-512 GEMM is faster from about 512 rows (docs/benchmarks.md).
``max_kernel_rows`` switches larger inputs to dequantize + float32 GEMM; nothing sets it yet.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
import torch.nn.functional as F
from tokenmill_kernels import quant_matmul
from tokenmill_kernels.quant_matmul import cpu as quant_cpu
from torch import nn

from tokenmill.layers.quantizer import Quantizer, layer_bias, layer_tensor

logger = logging.getLogger(__name__)

GROUP_SIZE = 32


class _WeightOnlyQuantizer(Quantizer):
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu",)
    input_group_size: int = GROUP_SIZE
    #: Above this many rows of ``x``, dequantize and run one float32 GEMM instead (None: never).
    max_kernel_rows: ClassVar[int | None] = None

    @classmethod
    def is_available(cls) -> bool:
        return quant_cpu.is_available()

    def __init__(self, options: object = None) -> None:  # the quant plugin's options; these read none
        quant_cpu.prepare()  # start building (first run on a machine) or loading the C++ now, beside the weights

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype
    ) -> None:
        if dtype != torch.float32:
            raise ValueError(f"quantizer {self.name!r} computes in float32; set model.dtype to float32 or auto")
        if in_features % GROUP_SIZE:
            raise ValueError(
                f"quantizer {self.name!r} needs in_features divisible by {GROUP_SIZE}, got {in_features}; "
                "use model.quantization = 'none' for this model"
            )
        # Quantized storage is shaped by the kernel's layout, known once a weight arrives:
        # placeholders now, replaced in load_weight.
        for name in self.storage_names:
            layer.register_buffer(name, torch.empty(0, dtype=torch.uint8))
        bias_param = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        layer.register_parameter("bias", bias_param)  # None declares it absent

    def load_weight(self, layer: nn.Module, param_name: str, tensor: torch.Tensor) -> None:
        if param_name == "bias":
            layer_tensor(layer, "bias").data.copy_(tensor)
            return
        device = getattr(layer, self.storage_names[0]).device
        try:
            storage = self.quantize(tensor.float().contiguous())
        except ValueError as e:
            raise ValueError(f"quantizer {self.name!r}: {e}; use model.quantization = 'none' for this model") from e
        for name, value in zip(self.storage_names, storage, strict=True):
            setattr(layer, name, value.to(device))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():  # attribute reads: a no-op .float() is a dispatch
            x = x.float().contiguous()
        # The layer's tensors, read through nn.Module's __getattr__ once (a microsecond a lookup, four per
        # linear, every step), and again whenever its first storage tensor is replaced.
        buffers = layer._buffers
        cached = layer.__dict__.get("_weight_only_storage")
        if cached is None or cached[0] is not buffers[self.storage_names[0]]:
            cached = (*(buffers[name] for name in self.storage_names), layer_bias(layer))
            layer.__dict__["_weight_only_storage"] = cached
        *storage, bias = cached
        if self.max_kernel_rows is not None and x.shape[0] > self.max_kernel_rows:
            return F.linear(x, self.dequantize(*storage), bias)
        return self.matmul(x, *storage, bias=bias)

    # What each scheme supplies.
    storage_names: ClassVar[tuple[str, ...]]

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def dequantize(self, *storage: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, *storage: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class Int8Quantizer(_WeightOnlyQuantizer):
    """8-bit weights, one scale per 32 (Q8_0 numerics): ~half the bytes of float16, near-lossless."""

    name: ClassVar[str] = "int8"
    lossless_for: ClassVar[tuple[str, ...]] = ("Q8_0",)
    # Every GGUF type of fewer bits (K-quants, i-quants): 255 steps per 32 weights against their 3 to 63.
    near_lossless_for: ClassVar[tuple[str, ...]] = (
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS",
        "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
    )  # fmt: skip
    auto_priority: ClassVar[int] = 10
    storage_names: ClassVar[tuple[str, ...]] = ("qweight", "scales")

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return quant_matmul.quantize_int8(weight)

    def dequantize(self, *storage: torch.Tensor) -> torch.Tensor:
        return quant_matmul.dequantize_int8(*storage)

    def matmul(self, x: torch.Tensor, *storage: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qweight, scales = storage
        return quant_matmul.matmul_int8(x, qweight, scales, bias)


class Int4Quantizer(_WeightOnlyQuantizer):
    """4-bit weights with a scale and minimum per 32 (Q4_1 numerics); the output projection stays
    8-bit, as in GGUF files, since it decides every token."""

    name: ClassVar[str] = "int4"
    lossless_for: ClassVar[tuple[str, ...]] = ("Q4_1",)
    auto_priority: ClassVar[int] = 10
    storage_names: ClassVar[tuple[str, ...]] = ("qweight", "scales", "mins")

    def output_quantizer(self) -> Quantizer:
        return Int8Quantizer()

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return quant_matmul.quantize_int4(weight)

    def dequantize(self, *storage: torch.Tensor) -> torch.Tensor:
        return quant_matmul.dequantize_int4(*storage)

    def matmul(self, x: torch.Tensor, *storage: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qweight, scales, mins = storage
        return quant_matmul.matmul_int4(x, qweight, scales, mins, bias)
