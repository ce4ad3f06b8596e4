"""Registers the layer kernels ``cpu`` and ``triton`` (registration only: no torch or Triton import here)."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl


@hookimpl
def tokenmill_register_layer_kernels(register: Register) -> None:
    register("cpu", "tokenmill_plugins.layer_kernels.cpu_kernels:CpuLayerKernels")
    register("triton", "tokenmill_plugins.layer_kernels.triton_kernels:TritonLayerKernels")
