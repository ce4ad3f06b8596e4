"""The ``cpu`` fused experts: a MoE layer's ``int8`` or ``int4`` routed experts in one C++ call
(``tokenmill_kernels.quant_matmul.experts``), through the same quantized matmul tiles as their linears.

The ``torch`` reference runs each chosen expert through its own linears: at one token, with two experts, that is
about ten Python calls and torch dispatches a layer around four matmuls, which cost about as much as the matmuls'
reads (docs/benchmarks.md, "A 1B Qwen3-MoE against llama-server"). Here the pairs are grouped by expert, each
expert's gate/up, activation, down and weighted sum run in C++, and the host makes one call a layer, the routing
included (``apply_routed``: the router's logits, softmax and top-k, a few torch calls otherwise).

Experts of other quantizers (``none``, GPTQ, AWQ, compressed-tensors), activations in other dtypes than float32,
inputs that need gradients, and LoRA adapters on the experts go to the reference, which handles them all; so does
a layer whose experts carry biases.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import torch
from tokenmill_kernels.quant_matmul import cpu as quant_matmul

from tokenmill.layers.fused_experts import TorchFusedExperts
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe import ExpertMLP, Experts
from tokenmill_plugins.quant.weight_only import Int4Quantizer, Int8Quantizer

_QUANTIZERS = (Int4Quantizer, Int8Quantizer)


class CpuFusedExperts(TorchFusedExperts):
    name: ClassVar[str] = "cpu"
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu",)
    #: Above ``torch`` (0).
    auto_priority: ClassVar[int] = 5
    #: Adapters on the experts run, through the reference.
    supports_lora: ClassVar[bool] = True

    @classmethod
    def is_available(cls) -> bool:
        return quant_matmul.is_available()

    def __init__(self) -> None:
        quant_matmul.prepare()  # build (first run on a machine) or load beside the weights
        # Each layer's experts as the C++ holds them (None: the reference runs them), and the tensor that was
        # their first storage when they were made: loading weights again replaces it.
        self._native: weakref.WeakKeyDictionary[Experts, tuple[Any, torch.Tensor | None]] = weakref.WeakKeyDictionary()

    def apply(
        self, experts: Experts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        native = self._runs(experts, x)
        if native is None:
            return super().apply(experts, x, topk_weights, topk_ids)
        if topk_weights.dtype is not torch.float32:
            topk_weights = topk_weights.float()
        return native.apply(x if x.is_contiguous() else x.contiguous(), topk_ids, topk_weights)

    def apply_routed(
        self, experts: Experts, x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool
    ) -> torch.Tensor | None:
        native = self._runs(experts, x)
        if native is None or router_weight.dtype is not torch.float32:
            return None
        return native.apply_routed(x if x.is_contiguous() else x.contiguous(), router_weight, top_k, renormalize)

    def _runs(self, experts: Experts, x: torch.Tensor) -> Any:
        """The C++ experts when they run ``x`` (float32, no gradients, no adapters on the experts), else None."""
        if experts.lora is not None or x.dtype is not torch.float32 or x.requires_grad:
            return None
        cached = self._native.get(experts)
        expert = experts[0] if len(experts) else None
        first = expert.gate_up_proj._buffers.get("qweight") if isinstance(expert, ExpertMLP) else None
        if cached is None or cached[1] is not first:
            cached = (_native_experts(experts), first)
            self._native[experts] = cached
        return cached[0]


def _native_experts(experts: Experts) -> Any:
    """The layer's experts for the C++ kernel, or None when it cannot run them (see the module's docstring)."""
    mlps = [expert for expert in experts if isinstance(expert, ExpertMLP)]
    if not mlps or len(mlps) != len(experts):
        return None
    kind = type(mlps[0].gate_up_proj.quantizer)
    linears: list[Linear] = [linear for mlp in mlps for linear in (mlp.gate_up_proj, mlp.down_proj)]
    if kind not in _QUANTIZERS or any(
        type(linear.quantizer) is not kind or linear.bias is not None for linear in linears
    ):
        return None
    codes = [linear._buffers["qweight"] for linear in linears]
    if any(code is None or code.device.type != "cpu" for code in codes):
        return None
    names = kind.storage_names
    gate_up = [linear._buffers[name] for linear in linears[::2] for name in names]
    down = [linear._buffers[name] for linear in linears[1::2] for name in names]
    return quant_matmul.experts(gate_up, down, gelu=mlps[0].is_gelu)  # type: ignore[arg-type]
