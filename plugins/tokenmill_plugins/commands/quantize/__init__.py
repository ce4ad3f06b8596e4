"""``tokenmill quantize``: GPTQ, AWQ, FP8 and INT8 checkpoints in compressed-tensors format."""

from __future__ import annotations

from tokenmill_plugins.commands.quantize.schemes import (
    METHODS,
    QuantizedWeight,
    QuantizeError,
    QuantScheme,
    make_scheme,
)

__all__ = ["METHODS", "QuantScheme", "QuantizeError", "QuantizedWeight", "make_scheme"]
