"""Registers the built-in quantizer ``none``, layer kernels ``torch`` and fused experts ``torch`` (registration
only: no torch import here)."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl


@hookimpl
def tokenmill_register_quantizers(register: Register) -> None:
    register("none", "tokenmill.layers.dense:DenseQuantizer")


@hookimpl
def tokenmill_register_layer_kernels(register: Register) -> None:
    register("torch", "tokenmill.layers.kernels:TorchLayerKernels")


@hookimpl
def tokenmill_register_fused_experts(register: Register) -> None:
    register("torch", "tokenmill.layers.fused_experts:TorchFusedExperts")
