"""Weight-only int8 / int4 quantized matmul for CPU decoding (AVX2 kernels, plain-torch reference).

``quantize_*`` / ``dequantize_*`` run once at load time and are plain torch; ``matmul_*`` run the C++ kernels,
compiled on first use. The formats and exact numerics are documented in :mod:`.reference`.
"""

from __future__ import annotations

from tokenmill_kernels.quant_matmul.cpu import is_available, load, matmul_int4, matmul_int8
from tokenmill_kernels.quant_matmul.reference import (
    GROUP,
    dequantize_int4,
    dequantize_int8,
    pack_int4_codes,
    quantize_int4,
    quantize_int8,
)

__all__ = [
    "GROUP",
    "dequantize_int4",
    "dequantize_int8",
    "is_available",
    "load",
    "matmul_int4",
    "matmul_int8",
    "pack_int4_codes",
    "quantize_int4",
    "quantize_int8",
]
