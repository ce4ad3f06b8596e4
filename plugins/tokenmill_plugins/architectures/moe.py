"""Mixtures of experts on the Llama family's layers: Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral.

Each is a Llama-family model whose feed-forward block is a ``SparseMoeBlock`` (``tokenmill.layers.moe``) on its
sparse layers. Routing is each family's own: softmax over the experts, top-k, renormalised always (Mixtral) or per
``norm_topk_prob`` (Qwen). Mixtral's checkpoints name the block ``block_sparse_moe`` and its experts' linears
``w1``/``w3``/``w2``; they are read under the Qwen names, as vLLM maps them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from torch import nn

from tokenmill.layers.moe import MoEConfig, SparseMoeBlock, local_expert_tensors
from tokenmill.models.architecture import ArchitectureConfig, ArchitectureError
from tokenmill.models.llama import LlamaForCausalLM, LlamaModel
from tokenmill.parallel import SplitInput
from tokenmill.weights.format import LoadedTensor


def moe_config(config: ArchitectureConfig) -> MoEConfig:
    """The MoE block of a Qwen-MoE or Mixtral config (``num_experts`` or ``num_local_experts``)."""
    hf = config.hf_config
    num_experts = hf.get("num_experts") or hf.get("num_local_experts")
    top_k = hf.get("num_experts_per_tok")
    if not isinstance(num_experts, int) or not isinstance(top_k, int) or not 0 < top_k <= num_experts:
        raise ArchitectureError(
            f"config needs num_experts (or num_local_experts) and 0 < num_experts_per_tok <= it; got "
            f"{num_experts!r} and {top_k!r}"
        )
    is_mixtral = config.model_type == "mixtral"
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(hf.get("moe_intermediate_size") or config.intermediate_size),
        renormalize=True if is_mixtral else bool(hf.get("norm_topk_prob", False)),
        shared_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        has_shared_expert_gate=bool(hf.get("shared_expert_intermediate_size")),
        hidden_act=config.hidden_act,
    )


def is_sparse_layer(config: ArchitectureConfig, layer_index: int) -> bool:
    """Whether layer ``layer_index`` is a MoE layer (Qwen's ``mlp_only_layers`` and ``decoder_sparse_step`` leave
    some dense)."""
    hf = config.hf_config
    step = int(hf.get("decoder_sparse_step") or 1)
    return layer_index not in (hf.get("mlp_only_layers") or ()) and (layer_index + 1) % step == 0


class MoEModel(LlamaModel):
    def build_mlp(self, config: ArchitectureConfig, layer_index: int, *args: Any) -> nn.Module | None:
        quantizer, dtype, tp = args
        if not is_sparse_layer(config, layer_index):
            return None  # the dense LlamaMLP of intermediate_size
        return SparseMoeBlock(moe_config(config), config.hidden_size, quantizer, dtype, tp)


class MoEForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE (``Qwen3MoeForCausalLM``), Qwen2-MoE (``Qwen2MoeForCausalLM``) and Mixtral
    (``MixtralForCausalLM``)."""

    model_class: ClassVar[type[LlamaModel]] = MoEModel

    @classmethod
    def tensor_parallel_inputs(cls, config: ArchitectureConfig, expert_parallel: bool) -> list[SplitInput]:
        """The dense layers' down_proj (if any layer is dense), the experts' (sliced unless expert-parallel) and
        the shared expert's (always sliced)."""
        moe = moe_config(config)
        splits = []
        if any(not is_sparse_layer(config, index) for index in range(config.num_layers)):
            splits += super().tensor_parallel_inputs(config, expert_parallel)
        if not expert_parallel:
            hint = " or parallel.enable_expert_parallel = true"
            experts = SplitInput("expert intermediate size", "the experts' down_proj", moe.intermediate_size, hint)
            splits.append(experts)
        if moe.shared_intermediate_size:
            shared = moe.shared_intermediate_size
            splits.append(SplitInput("shared expert intermediate size", "the shared expert's down_proj", shared))
        return splits

    def load_weights(self, tensors: Iterable[LoadedTensor]) -> None:
        tensors = _qwen_names(tensors) if self.config.model_type == "mixtral" else tensors
        super().load_weights(local_expert_tensors(self, tensors))  # an expert-parallel shard's experts only


#: Mixtral's checkpoint names -> the Qwen names the block is built with.
_MIXTRAL_NAMES = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _qwen_names(tensors: Iterable[LoadedTensor]) -> Iterator[LoadedTensor]:
    for item in tensors:
        parts = [_MIXTRAL_NAMES.get(part, part) for part in item.name.split(".")]
        yield LoadedTensor(".".join(parts), item.tensor, item.file)
