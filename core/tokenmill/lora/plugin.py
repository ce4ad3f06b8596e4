"""Registers the built-in LoRA kernels ``torch`` (registration only: no torch import here)."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl


@hookimpl
def tokenmill_register_lora_kernels(register: Register) -> None:
    register("torch", "tokenmill.lora.kernels:TorchLoRAKernels")
