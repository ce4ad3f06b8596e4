"""Registers the layer kernels ``triton`` (registration only: no torch or Triton import here)."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl


@hookimpl
def tokenmill_register_layer_kernels(register: Register) -> None:
    register("triton", "tokenmill_plugins.layer_kernels.triton_kernels:TritonLayerKernels")
