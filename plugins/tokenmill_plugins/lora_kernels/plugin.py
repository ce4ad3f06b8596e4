"""Registers the LoRA kernels ``cpu`` and ``triton`` (registration only: no torch import here)."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl


@hookimpl
def tokenmill_register_lora_kernels(register: Register) -> None:
    register("cpu", "tokenmill_plugins.lora_kernels.cpu_kernels:CpuLoRAKernels")
    register("triton", "tokenmill_plugins.lora_kernels.triton_kernels:TritonLoRAKernels")
