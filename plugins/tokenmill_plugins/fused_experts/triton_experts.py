"""The ``triton`` fused experts: a MoE layer's routed experts in two grouped-matmul launches on a GPU
(``tokenmill_kernels.fused_moe.triton``), with no host read of the routing, so a step with experts can be captured
in a CUDA graph.

They run dense experts (the ``none`` quantizer's weights, stacked once per layer on the first call and kept);
quantized experts (``int8``, ``int4``, GPTQ, AWQ), activations in other dtypes, and inputs that need gradients go to
the ``torch`` reference, which runs each expert's own quantized linears. They do not run LoRA adapters on the
experts (``supports_lora`` is False), so ``auto`` picks them on CUDA only without ``--enable-lora``. Triton is a
GPU extra: the kernels are imported when the plugin is built, so this module imports, and ``auto`` passes it over,
on a CPU install without Triton. On CPU they run only under the Triton interpreter, built directly (for tests).
"""

from __future__ import annotations

import importlib.util
import weakref
from typing import ClassVar

import torch

from tokenmill.layers.fused_experts import TorchFusedExperts
from tokenmill.layers.moe import ExpertMLP, Experts
from tokenmill_plugins.triton_import import load_gpu_kernels


class TritonFusedExperts(TorchFusedExperts):
    name: ClassVar[str] = "triton"
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    #: Above ``torch`` (0).
    auto_priority: ClassVar[int] = 5
    supports_lora: ClassVar[bool] = False

    @classmethod
    def is_available(cls) -> bool:
        """A CUDA device is visible and Triton is installed (the CPU interpreter is for tests only)."""
        return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None

    def __init__(self) -> None:
        self._kernels = load_gpu_kernels(
            "tokenmill_kernels.fused_moe.triton", "the fused_expert 'triton'", "select --fused-experts torch"
        )
        # Each layer's experts stacked once, kept while the layer lives.
        self._stacked: weakref.WeakKeyDictionary[Experts, tuple[torch.Tensor, torch.Tensor, str]] = (
            weakref.WeakKeyDictionary()
        )

    def captures(self, experts: Experts, dtype: torch.dtype) -> bool:
        """Dense experts in a dtype the kernels take; the rest goes to the ``torch`` reference, which cannot."""
        return dtype in self._kernels.SUPPORTED_DTYPES and _dense(experts)

    def apply(
        self, experts: Experts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        stacked = self._stacked.get(experts)
        if stacked is None:
            stacked = self._stack(experts)
            if stacked is None:
                return super().apply(experts, x, topk_weights, topk_ids)
            self._stacked[experts] = stacked
        gate_up, down, activation = stacked
        if x.dtype not in self._kernels.SUPPORTED_DTYPES or x.dtype != gate_up.dtype or x.requires_grad:
            return super().apply(experts, x, topk_weights, topk_ids)
        return self._kernels.fused_experts(x, gate_up, down, topk_weights, topk_ids, activation)

    @staticmethod
    def _stack(experts: Experts) -> tuple[torch.Tensor, torch.Tensor, str] | None:
        """The layer's dense weights stacked, and its activation; None for quantized experts."""
        if not _dense(experts):
            return None
        gate_up, down = experts.stacked_weights()
        return gate_up.contiguous(), down.contiguous(), "gelu_tanh" if experts[0].is_gelu else "silu"


def _dense(experts: Experts) -> bool:
    """Every expert an ``ExpertMLP`` with dense (unquantized) weights."""
    return all(isinstance(expert, ExpertMLP) and expert.gate_up_proj.quantizer.is_dense for expert in experts)
