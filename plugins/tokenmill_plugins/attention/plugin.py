"""Registers the attention backends: ``cpu`` (AVX2 kernels), ``triton`` and ``cuda`` (GPU).

Registration only: no torch, Triton or CuPy import here."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl


@hookimpl
def tokenmill_register_attention_backends(register: Register) -> None:
    register("cpu", "tokenmill_plugins.attention.cpu_backend:CpuAttentionBackend")
    register("triton", "tokenmill_plugins.attention.triton_backend:TritonAttentionBackend")
    register("cuda", "tokenmill_plugins.attention.cuda_backend:CudaAttentionBackend")
