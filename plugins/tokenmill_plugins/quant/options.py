"""The quant plugin's options: the ``[plugins.quant]`` table."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class QuantOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Options of the first-party quantizers."""

    #: How a quantized checkpoint's float output projection (``lm_head``, or the embedding it is tied to) runs.
    #: ``"checkpoint"`` keeps it as the checkpoint stores it (float, as GPTQ, AWQ and llm-compressor leave it);
    #: ``"int8"`` quantizes it at load to int8 groups of 32 (GGUF's Q8_0, as the default Q4_1 file stores it),
    #: which reads a quarter of the bytes per token: on SmolLM2-135M most of a 4-bit checkpoint's decode time at
    #: one request goes to the float projection.
    output_quantization: Annotated[
        Literal["checkpoint", "int8"],
        msgspec.Meta(description="Output projection of gptq/awq/compressed-tensors checkpoints: as stored, or int8."),
    ] = "checkpoint"
