"""Registers the fused experts kernels ``cpu`` and ``triton`` (registration only: no torch import here)."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl


@hookimpl
def tokenmill_register_fused_experts(register: Register) -> None:
    register("cpu", "tokenmill_plugins.fused_experts.cpu_experts:CpuFusedExperts")
    register("triton", "tokenmill_plugins.fused_experts.triton_experts:TritonFusedExperts")
