"""OLMoE (``OlmoeForCausalLM``): a mixture of experts on the Llama family's layers, routed as Qwen-MoE routes
(softmax, top-k, renormalised per ``norm_topk_prob``), whose q/k norms run over each projection's whole width
(every head at once, where Qwen3's run per head), with q, k and v optionally clipped after them (``clip_qkv``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.architecture import ArchitectureConfig
from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel
from tokenmill.parallel.group import TensorParallelGroup
from tokenmill.weights.format import LoadedTensor
from tokenmill_plugins.architectures.moe import MoEForCausalLM, MoEModel


class ProjectionRMSNorm(RMSNorm):
    """RMSNorm over a projection's whole width, of which this tensor-parallel shard holds ``width`` columns of
    ``full_width``: over several shards, their sums of squares are added before the root is taken (in float32, as
    transformers' ``OlmoeRMSNorm``); over one, it is the layer kernels' norm."""

    def __init__(self, width: int, full_width: int, eps: float, dtype: torch.dtype, tp: TensorParallelGroup) -> None:
        super().__init__(width, eps, dtype)
        self.full_width = full_width
        self.tp = tp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        assert residual is None, "a projection's norm adds no residual"
        if self.tp.size == 1:
            return super().forward(x)
        x32 = x.float()
        sum_of_squares = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True))
        return self.weight * (x32 * torch.rsqrt(sum_of_squares / self.full_width + self.eps)).to(x.dtype)


class OlmoeAttention(LlamaAttention):
    def __init__(self, config: ArchitectureConfig, *args: Any) -> None:
        super().__init__(config, *args)
        dtype, tp = args[-2:]  # after (layer_index, rotary, backend, quantizer)
        spec, eps = self.spec, config.rms_norm_eps
        self.sizes = (spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim)
        full = (config.num_attention_heads * config.head_dim, config.num_kv_heads * config.head_dim)
        self.q_norm = ProjectionRMSNorm(self.sizes[0], full[0], eps, dtype, tp)
        self.k_norm = ProjectionRMSNorm(self.sizes[1], full[1], eps, dtype, tp)
        clip = config.hf_config.get("clip_qkv")
        self.clip_qkv = None if clip is None else float(clip)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, spec = hidden_states.shape[0], self.spec
        q_size, kv_size = self.sizes
        query, key, value = self.qkv_proj(hidden_states).split_with_sizes((q_size, kv_size, kv_size), dim=-1)
        assert self.q_norm is not None and self.k_norm is not None
        query_and_key = torch.cat([self.q_norm(query), self.k_norm(key)], dim=-1)
        if self.clip_qkv is not None:
            query_and_key = query_and_key.clamp(-self.clip_qkv, self.clip_qkv)
            value = value.clamp(-self.clip_qkv, self.clip_qkv)
        query_and_key = self.rotary[0].rotate(query_and_key.view(num_tokens, -1, spec.head_dim))
        query, key = query_and_key.split_with_sizes((spec.num_heads, spec.num_kv_heads), dim=1)
        value = value.reshape(num_tokens, spec.num_kv_heads, spec.head_dim)
        out = self.backend.forward(spec, query, key, value, kv_cache, metadata)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, q_size)))


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_class: ClassVar[type[LlamaAttention]] = OlmoeAttention


class OlmoeModel(MoEModel):
    layer_class: ClassVar[type[LlamaDecoderLayer]] = OlmoeDecoderLayer


class OlmoeForCausalLM(MoEForCausalLM):
    """OLMoE (``OlmoeForCausalLM``)."""

    model_class: ClassVar[type[LlamaModel]] = OlmoeModel

    def load_weights(self, tensors: Iterable[LoadedTensor]) -> None:
        super().load_weights(self._norm_shards(tensors))

    def _norm_shards(self, tensors: Iterable[LoadedTensor]) -> Iterator[LoadedTensor]:
        """The q/k norm weights cut to this shard's heads (the checkpoint holds every head's)."""
        tp = self.tp
        for item in tensors:
            if tp.size > 1 and item.name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                width = item.tensor.shape[0] // tp.size
                item = LoadedTensor(item.name, item.tensor[tp.rank * width : (tp.rank + 1) * width], item.file)
            yield item
