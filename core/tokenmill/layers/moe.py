"""A mixture-of-experts feed-forward block: a router picks ``top_k`` experts per token, the experts' MLPs run on
the tokens routed to them (``tokenmill.layers.fused_experts``), and a shared expert, where the model has one, runs
on every token.

Weights are stored per expert, under the checkpoints' names (``experts.{e}.gate_proj``/``up_proj`` merged into
``gate_up_proj``, ``experts.{e}.down_proj``), each a ``Linear`` over the model's quantizer; ``Experts.stacked_weights``
stacks the dense ones for kernels that run all experts in one call.

With tensor parallelism each shard holds a slice of every expert's inner dimension (as a dense MLP's). With expert
parallelism (``parallel.enable_expert_parallel``) each shard holds whole experts instead, every ``size``-th one
(``TensorParallelGroup.local_experts``): every shard routes all tokens, runs the pairs whose expert it holds, and
passes the others to the kernels as expert -1, which adds nothing. Either way each shard's output is a partial sum
that the block all-reduces once, with the shared expert's, which stays tensor-parallel (sliced) in both modes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.fast_module import FastModule
from tokenmill.layers.fused_experts import UsesFusedExperts
from tokenmill.layers.kernels import UsesLayerKernels
from tokenmill.layers.linear import Linear, LinearShard, MergedLinear
from tokenmill.layers.quantizer import Quantizer, layer_tensor
from tokenmill.parallel.group import TensorParallelGroup, single_process_group
from tokenmill.weights.format import LoadedTensor

if TYPE_CHECKING:
    from tokenmill.lora.layers import RoutedLoRA


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts block's shape and routing, as a model family states it."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's inner width
    #: Renormalise the top-k router probabilities to sum to one (Mixtral always; Qwen's ``norm_topk_prob``).
    renormalize: bool
    #: A shared expert on every token, its inner width (0: none), and whether a sigmoid gate scales it (Qwen2-MoE).
    shared_intermediate_size: int = 0
    has_shared_expert_gate: bool = False
    hidden_act: str = "silu"


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (float32), then the ``top_k`` largest, renormalised to sum to one when asked:
    ``(topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] int64)``. Renormalised, that is
    the softmax of the ``top_k`` largest logits, computed so: two operations instead of four, a few microseconds
    of each MoE layer at one token, equal up to float rounding."""
    if renormalize:
        top_logits, topk_ids = router_logits.float().topk(top_k, dim=-1)
        return top_logits.softmax(dim=-1), topk_ids
    top_weights, topk_ids = router_logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    return top_weights, topk_ids


def _shard(tp: TensorParallelGroup, dim: int) -> LinearShard | None:
    return LinearShard(dim, tp.rank, tp.size) if tp.size > 1 else None


class ExpertMLP(UsesLayerKernels):
    """One expert (or the shared expert): ``down(act(gate(x)) * up(x))``, without the tensor-parallel sum."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        quantizer: Quantizer,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        inner = intermediate_size // tp.size
        self.gate_up_proj = MergedLinear(hidden_size, (inner, inner), False, quantizer, dtype, _shard(tp, 0))
        self.down_proj = Linear(inner, hidden_size, False, quantizer, dtype, _shard(tp, 1))
        self.is_gelu = hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        kernels = self.layer_kernels
        return self.down_proj(kernels.gelu_tanh_and_mul(gate_up) if self.is_gelu else kernels.silu_and_mul(gate_up))


class Experts(nn.ModuleList):
    """The routed experts, ``experts[e]`` an ``ExpertMLP`` (checkpoint names ``experts.{e}.*``)."""

    #: With LoRA enabled under fused experts kernels that support it: what tells the experts' adapters which tokens
    #: each expert runs on (``FusedExperts.supports_lora``).
    lora: RoutedLoRA | None = None

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert's dense weights stacked: ``gate_up`` [num_experts, 2 * inner, hidden] and ``down``
        [num_experts, hidden, inner], for kernels that run all experts in one call. A copy, made on each call: a
        kernel keeps it (from a ``FusedExperts.apply``'s first call, say). Only for the ``none`` quantizer's
        weights (a quantized expert's layout belongs to its quantizer)."""
        experts = [expert for expert in self if isinstance(expert, ExpertMLP)]
        assert len(experts) == len(self)
        gate_up = torch.stack([layer_tensor(expert.gate_up_proj, "weight") for expert in experts])
        down = torch.stack([layer_tensor(expert.down_proj, "weight") for expert in experts])
        return gate_up, down


class Router(FastModule):
    """The router's linear (``gate``), kept in the model's dtype whatever the quantizer, as quantized MoE
    checkpoints keep it: [num_tokens, hidden] -> [num_tokens, num_experts] logits."""

    def __init__(self, hidden_size: int, num_outputs: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_outputs, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(UsesFusedExperts):
    """The feed-forward block of a MoE layer, named as Hugging Face's (``gate``, ``experts``, ``shared_expert``,
    ``shared_expert_gate``), so that it takes an ``mlp``'s place in a decoder layer."""

    def __init__(
        self,
        config: MoEConfig,
        hidden_size: int,
        quantizer: Quantizer,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.renormalize = config.renormalize
        self.tp = tp
        self.gate = Router(hidden_size, config.num_experts, dtype)
        # Expert parallelism: this shard's whole experts; otherwise every expert, sliced as a dense MLP is.
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        expert_tp = single_process_group() if self.expert_parallel else tp
        self.experts = Experts(
            ExpertMLP(hidden_size, config.intermediate_size, config.hidden_act, quantizer, dtype, expert_tp)
            for _ in tp.local_experts(config.num_experts)
        )
        self.shared_expert = (
            ExpertMLP(hidden_size, config.shared_intermediate_size, config.hidden_act, quantizer, dtype, tp)
            if config.shared_intermediate_size
            else None
        )
        self.shared_expert_gate = Router(hidden_size, 1, dtype) if config.has_shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (
            None
            if self.expert_parallel
            else self.fused_experts.apply_routed(self.experts, x, self.gate.weight, self.top_k, self.renormalize)
        )
        if out is None:
            out = self._route_and_apply(x)  # [num_tokens, hidden]
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.tp.all_reduce(out)

    def _route_and_apply(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        if self.expert_parallel:  # global ids -> this shard's places (e // size), or -1: another shard's expert
            tp = self.tp
            topk_ids = torch.where(topk_ids % tp.size == tp.rank, topk_ids // tp.size, -1)
        if topk_weights.dtype != x.dtype:
            topk_weights = topk_weights.to(x.dtype)
        return self.fused_experts.apply(self.experts, x, topk_weights, topk_ids)


def experts_read_on_the_host(model: nn.Module) -> str | None:
    """Why a step of ``model`` cannot be captured in a CUDA graph because of its MoE layers (their fused experts
    read the routing on the host: ``FusedExperts.captures``), or None. Called once at start-up."""
    for block in model.modules():
        if isinstance(block, SparseMoeBlock) and not block.fused_experts.captures(
            block.experts, block.gate.weight.dtype
        ):
            return f"fused experts {block.fused_experts.name!r} read each step's routing on the host"
    return None


def local_expert_tensors(model: nn.Module, tensors: Iterable[LoadedTensor]) -> Iterator[LoadedTensor]:
    """``tensors`` (Hugging Face names) as an expert-parallel shard of ``model`` loads them: expert ``e`` of each
    ``SparseMoeBlock`` renamed to its place in the shard's ``Experts`` (``experts.{e // size}``), other shards'
    experts left out. Unchanged without expert parallelism. For an architecture's ``load_weights``."""
    groups = {
        f"{name}.experts.": block.tp
        for name, block in model.named_modules()
        if isinstance(block, SparseMoeBlock) and block.expert_parallel
    }
    for item in tensors:
        block, found, rest = item.name.partition(".experts.")
        tp = groups.get(block + found)
        if tp is None:
            yield item
            continue
        expert, _, param = rest.partition(".")
        if not expert.isdigit():  # not an expert of ours: the model's loader names it
            yield item
        elif int(expert) % tp.size == tp.rank:
            yield LoadedTensor(f"{block}.experts.{int(expert) // tp.size}.{param}", item.tensor, item.file)
