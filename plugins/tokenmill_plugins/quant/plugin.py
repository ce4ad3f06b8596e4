"""Registers the quantizers (registration only: no torch import here).

``int8`` and ``int4`` quantize float weights at load (GGUF Q8_0 / Q4_1 numerics); ``gptq``, ``awq`` and
``compressed-tensors`` read checkpoints quantized by other tools, picked by their ``quant_method``.
"""

from __future__ import annotations

from tokenmill import hookimpl
from tokenmill.hookspecs import Register
from tokenmill_plugins.quant.options import QuantOptions


@hookimpl
def tokenmill_plugin_options() -> type[QuantOptions]:
    return QuantOptions


@hookimpl
def tokenmill_register_quantizers(register: Register) -> None:
    register("int8", "tokenmill_plugins.quant.weight_only:Int8Quantizer")
    register("int4", "tokenmill_plugins.quant.weight_only:Int4Quantizer")
    register("gptq", "tokenmill_plugins.quant.gptq:GPTQQuantizer")
    register("awq", "tokenmill_plugins.quant.awq:AWQQuantizer")
    register("compressed-tensors", "tokenmill_plugins.quant.compressed_tensors:CompressedTensorsQuantizer")
