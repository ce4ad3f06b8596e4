"""LoRA adapters: whether they are served, how many at once, and the kernels that apply them (docs/lora.md).

The flags are vLLM's: ``--enable-lora``, ``--lora-modules name=path``, ``--max-loras``, ``--max-lora-rank``,
``--max-cpu-loras``, ``--lora-dtype``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from tokenmill.config.base import ConfigSection, PositiveInt, describe


class LoRAConfig(ConfigSection, frozen=True):
    enable_lora: Annotated[
        bool,
        describe(
            "Serve LoRA adapters (PEFT format) over the base model: a request selects one by its `model` field "
            "(`LoRARequest` offline). Turns CUDA graphs off."
        ),
    ] = False
    lora_modules: Annotated[
        list[str],
        describe(
            "Adapters served from the start, each 'name=path' or vLLM's JSON "
            '\'{"name": ..., "path": ..., "base_model_name": ...}\'; needs --enable-lora.'
        ),
    ] = msgspec.field(default_factory=list)
    max_loras: Annotated[
        PositiveInt,
        describe(
            "Adapters in one step (slots on the device); a request whose adapter finds no slot waits while the "
            "others run."
        ),
    ] = 1
    max_lora_rank: Annotated[
        PositiveInt,
        describe("The largest rank an adapter may have; each slot holds this rank (smaller ones are zero-padded)."),
    ] = 16
    max_cpu_loras: Annotated[
        PositiveInt | None,
        describe("Adapters kept in host memory, least recently used first out (default: max_loras)."),
    ] = None
    allow_runtime_lora_updating: Annotated[
        bool,
        describe(
            "Let clients add and remove adapters while serving: POST /v1/load_lora_adapter and "
            "/v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING). An adapter is read from a path on "
            "the server's disk, so allow it only for trusted clients."
        ),
    ] = False
    lora_dtype: Annotated[
        Literal["auto", "float32", "float16", "bfloat16"],
        describe(
            "The adapters' weights' dtype in their slots: 'auto' is the model's dtype on a GPU; on a CPU, where they "
            "add in float32 whatever they are stored in, float16 over a quantized model (int4/int8, GPTQ, AWQ: half "
            "what a decode step reads per adapter, at about 3 significant decimal digits) and float32 over a float one."
        ),
    ] = "auto"
    lora_kernels: Annotated[
        str,
        describe(
            "LoRA kernels plugin (slot `lora_kernel`): 'torch' is the built-in reference; 'auto' picks the fastest "
            "installed one that runs on the device ('cpu', C++ with AVX2, on a CPU; 'triton' on a CUDA GPU)."
        ),
    ] = "auto"

    def __post_init__(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora.lora_modules is set but lora.enable_lora is not; add --enable-lora")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"lora.max_cpu_loras={self.max_cpu_loras} is below lora.max_loras={self.max_loras}; raise "
                "--max-cpu-loras or leave it unset"
            )
