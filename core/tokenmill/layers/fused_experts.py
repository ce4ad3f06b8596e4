"""Fused experts (slot ``fused_expert``): a mixture-of-experts layer's expert matmuls for the tokens routed to them.

A step's tokens each pick ``top_k`` of the layer's experts (``tokenmill.layers.moe``). What costs is the experts'
weights: reading every expert for every token would cost the whole model's weights per token. A ``FusedExperts``
implementation sorts the step's (token, expert) pairs by expert and runs each expert that has tokens once, over all
of them, then adds each result back to its token scaled by the router's weight (vLLM's ``FusedMoE``, SGLang's
``moe_align_block_size``, llama.cpp's ``ggml_mul_mat_id``). So a step's cost grows with the experts it touches, not
the experts the model has.

``TorchFusedExperts`` (``torch``) is the reference, built in: one gate/up and one down matmul per active expert
through the expert's own linears, whatever their quantizer (``int8``, ``int4``, GPTQ, AWQ...), so quantized experts
need nothing more. It reads the active experts on the host (one device sync per MoE layer), so a model whose
experts it runs is not captured in CUDA graphs (``FusedExperts.captures``). Faster kernels (a Triton fused-MoE,
CPU grouped int4/int8 matmuls) are plugins: they may read the experts' dense weights stacked
(``Experts.stacked_weights``).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from tokenmill.layers.fast_module import FastModule
from tokenmill.layers.kernels import SelectableKernels

if TYPE_CHECKING:
    from tokenmill.layers.moe import Experts


class FusedExperts(SelectableKernels):
    """Runs a MoE layer's experts over a step's tokens.

    Built once per engine process (with no arguments, plus ``options=`` when its plugin declares options). ``apply``
    is called once per MoE layer per step inside the forward; it must not call hooks or keep references to a step's
    tensors. Results must match ``TorchFusedExperts`` up to float rounding (``tokenmill.testing.check_fused_experts``).
    ``auto`` (``model.fused_experts``) picks by ``auto_priority`` among those ``auto_selectable`` on the device.
    """

    #: Whether ``apply`` runs LoRA adapters on the experts: when ``experts.lora`` is set, it calls
    #: ``experts.lora.route`` with each pair's token, grouped by expert, then ``experts.lora.select`` before each
    #: expert's linears run, as the reference does. Otherwise adapters on the routed experts are refused at load.
    supports_lora: ClassVar[bool] = False

    def captures(self, experts: Experts, dtype: torch.dtype) -> bool:
        """Whether ``apply`` on ``experts``, with activations in ``dtype``, runs on the device alone (no host read of
        the routing, no sync), so that a decode step can be captured in a CUDA graph (``tokenmill.cuda_graphs``).
        Asked once at start-up for each MoE layer; False unless an implementation says so."""
        return False

    def apply_routed(
        self, experts: Experts, x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool
    ) -> torch.Tensor | None:
        """``apply`` with the routing done here as well, as ``tokenmill.layers.moe.select_experts`` does it over
        the router logits ``x @ router_weight.T`` (``router_weight`` [num_experts, hidden], ``x``'s dtype), or None
        to leave the routing to the block, which then calls ``apply``: the default. Called first by a MoE block
        without expert parallelism; kernels whose host calls cost as much as their work at one token (a CPU's)
        save the router's few torch calls a layer."""
        return None

    @abstractmethod
    def apply(
        self, experts: Experts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """``sum_k topk_weights[t, k] * expert[topk_ids[t, k]](x[t])`` for every token ``t``: [num_tokens, hidden].

        :param experts: the layer's experts (``experts[e]`` is an ``ExpertMLP``; ``num_experts`` of them).
        :param x: [num_tokens, hidden] in the model's dtype.
        :param topk_weights: [num_tokens, top_k], the router's weights in ``x``'s dtype.
        :param topk_ids: [num_tokens, top_k] int64, each token's experts (distinct per token), indices into
            ``experts``; -1 marks a pair whose expert another shard holds (expert parallelism): it adds nothing.
        """


class TorchFusedExperts(FusedExperts):
    """The reference: tokens grouped by expert, each active expert's linears run once over its tokens."""

    name: ClassVar[str] = "torch"
    supports_lora: ClassVar[bool] = True

    def apply(
        self, experts: Experts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        lora = experts.lora
        if x.shape[0] == 1 and lora is None:
            return _one_token(experts, x, topk_weights, topk_ids)
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)  # [num_tokens * top_k]
        # The one host read; bin 0 counts the pairs whose expert is on another shard (-1).
        num_elsewhere, *counts = torch.bincount(flat_ids + 1, minlength=len(experts) + 1).tolist()
        order = flat_ids.argsort(stable=True)[num_elsewhere:]  # this shard's pairs, grouped by expert
        token_of_pair = order // top_k  # [num_pairs]
        weight_of_pair = topk_weights.reshape(-1)[order, None]  # [num_pairs, 1]
        sorted_x = x[token_of_pair]  # [num_pairs, hidden]
        out = torch.zeros_like(x)  # [num_tokens, hidden]
        if lora is not None:
            lora.route(token_of_pair)
        start = 0
        for expert_id, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            if lora is not None:
                lora.select(start, start + count)
            out.index_add_(0, token_of_pair[rows], experts[expert_id](sorted_x[rows]) * weight_of_pair[rows])
            start += count
        if lora is not None:
            lora.select(0, 0)
        return out


def _one_token(experts: Experts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``TorchFusedExperts.apply`` for one token (a decode step of one stream), the same sums in the same order
    without grouping pairs by expert: at one token, the grouping's torch calls cost about as much as the experts.
    (The grouped path adds into zeros; starting from the first product instead gives the same values.)"""
    ids = topk_ids[0].tolist()
    out = None
    for k in sorted(range(len(ids)), key=ids.__getitem__):  # by expert, as the grouped path adds them
        if ids[k] >= 0:
            weighted = experts[ids[k]](x) * topk_weights[:, k : k + 1]  # [1, hidden]
            out = weighted if out is None else out.add_(weighted)
    return torch.zeros_like(x) if out is None else out


class UsesFusedExperts(FastModule):
    """A module that runs experts: it reads the fused-experts kernels from ``self.fused_experts``, the torch
    reference until the model loader installs the selected ones (``install_fused_experts``)."""

    fused_experts: FusedExperts = TorchFusedExperts()


def install_fused_experts(model: nn.Module, kernels: FusedExperts) -> None:
    """Make every ``UsesFusedExperts`` module of ``model`` call ``kernels``."""
    for module in model.modules():
        if isinstance(module, UsesFusedExperts):
            module.fused_experts = kernels
