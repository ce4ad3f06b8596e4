"""Gemma 2 and Gemma 3 (text): the Llama family's layers with Gemma's differences.

- Embeddings are multiplied by ``sqrt(hidden_size)``, rounded to the model's dtype as the reference does.
- RMSNorm scales by ``1 + weight`` (``GemmaRMSNorm``), and each layer normalises the attention and MLP outputs too
  (``post_attention_layernorm``, ``post_feedforward_layernorm``) besides their inputs (``input_layernorm``,
  ``pre_feedforward_layernorm``).
- Queries are scaled by ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``.
- The MLP is GeGLU (tanh gelu): ``ArchitectureConfig.hidden_act``.
- Gemma 2 caps attention scores and final logits with ``cap * tanh(x / cap)``
  (``ArchitectureConfig.attention_logits_soft_cap``, ``final_logits_soft_cap``); Gemma 3 normalises q and k per
  head instead, and its sliding-window layers use their own rope base (``ArchitectureConfig.sliding_rope``).
- Sliding-window and global layers alternate (``ArchitectureConfig.sliding_windows``).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.layers.norm import GemmaRMSNorm, RMSNorm
from tokenmill.models.architecture import ArchitectureConfig
from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GemmaAttention(LlamaAttention):
    norm_class: ClassVar[type[RMSNorm]] = GemmaRMSNorm

    def attention_scale(self, config: ArchitectureConfig) -> float:
        return float(config.hf_config.get("query_pre_attn_scalar") or config.head_dim) ** -0.5


class GemmaDecoderLayer(LlamaDecoderLayer):
    attention_class: ClassVar[type[LlamaAttention]] = GemmaAttention
    norm_class: ClassVar[type[RMSNorm]] = GemmaRMSNorm

    def __init__(self, config: ArchitectureConfig, *args: Any, **kwargs: Any) -> None:
        """As ``LlamaDecoderLayer``'s, plus the norms of the MLP's input and output."""
        super().__init__(config, *args, **kwargs)
        dtype = self.input_layernorm.weight.dtype
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaDecoderLayer.forward``; each sublayer's output is normalised before the residual add."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states, kv_cache, metadata))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


@functools.cache
def _embedding_normalizer(hidden_size: int, dtype: torch.dtype) -> float:
    """``sqrt(hidden_size)`` rounded to ``dtype`` first, as the reference does (33.94 is 34.0 in bfloat16)."""
    return float(torch.tensor(hidden_size**0.5, dtype=dtype, device="cpu"))


class GemmaModel(LlamaModel):
    norm_class: ClassVar[type[RMSNorm]] = GemmaRMSNorm
    layer_class: ClassVar[type[LlamaDecoderLayer]] = GemmaDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedded = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        return embedded * _embedding_normalizer(embedded.shape[-1], embedded.dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``)."""

    model_class: ClassVar[type[LlamaModel]] = GemmaModel
