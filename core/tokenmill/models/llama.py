"""The Llama family: Llama (incl. llama3 rope scaling), Mistral, Qwen2, Qwen3, SmolLM.

One implementation serves them all; their differences are fields of
``ArchitectureConfig`` (biases, q/k norm, sliding windows, tied embeddings).
Module and parameter names follow Hugging Face's so checkpoints load by name.

Other families build on it (the ``architectures`` plugin: Gemma, Phi-3, the mixtures of experts): a subclass
names its own parts (``attention_class``, ``norm_class``, ``LlamaModel.build_layer``, ``mlp=``) instead of copying
the rest.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from tokenmill.layers.embedding import VocabParallelEmbedding
from tokenmill.layers.fast_module import FastModule
from tokenmill.layers.kernels import UsesLayerKernels
from tokenmill.layers.linear import Linear, LinearShard, MergedLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.quantizer import Quantizer
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.architecture import ArchitectureConfig
from tokenmill.models.base import CausalLM
from tokenmill.parallel.group import TensorParallelGroup, single_process_group


def _shard(tp: TensorParallelGroup, dim: int) -> LinearShard | None:
    """How a linear is split over the shards: along its output (``dim`` 0) or input (1); None unsharded."""
    return LinearShard(dim, tp.rank, tp.size) if tp.size > 1 else None


class LlamaAttention(FastModule):
    #: The q/k norm (``config.qk_norm``).
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(
        self,
        config: ArchitectureConfig,
        layer_index: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        quantizer: Quantizer,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        # This shard's heads: q/k/v are split by head (column-parallel), o_proj by its input (row-parallel).
        heads, kv_heads = config.num_attention_heads // tp.size, config.num_kv_heads // tp.size
        head_dim, hidden = config.head_dim, config.hidden_size
        qkv_sizes = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        self.qkv_proj = MergedLinear(hidden, qkv_sizes, config.qkv_bias, quantizer, dtype, _shard(tp, 0))
        self.o_proj = Linear(heads * head_dim, hidden, config.o_proj_bias, quantizer, dtype, _shard(tp, 1))
        self.tp = tp
        self.q_norm = self.norm_class(head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = self.norm_class(head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.spec = AttentionLayerSpec(
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            scale=self.attention_scale(config),
            sliding_window=config.sliding_windows[layer_index],
            logits_soft_cap=config.attention_logits_soft_cap,
        )
        self.backend = backend
        self.rotary = [rotary]  # in a list: shared by all layers, not a child module of each

    def attention_scale(self, config: ArchitectureConfig) -> float:
        """What scores are multiplied by before the softmax; called once, by the constructor."""
        return float(config.head_dim**-0.5)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        spec = self.spec
        # [num_tokens, heads + 2 * kv_heads, head_dim]. split_with_sizes, not split: the same views without
        # Tensor.split's Python wrapper, two microseconds a call at one token.
        qkv = self.qkv_proj(hidden_states).view(num_tokens, -1, spec.head_dim)
        query_and_key, value = qkv.split_with_sizes((spec.num_heads + spec.num_kv_heads, spec.num_kv_heads), dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = query_and_key.split_with_sizes((spec.num_heads, spec.num_kv_heads), dim=1)
            query_and_key = torch.cat([self.q_norm(query), self.k_norm(key)], dim=1)
        # Queries and keys are adjacent in the merged projection: rope rotates them in one pass.
        query_and_key = self.rotary[0].rotate(query_and_key)
        query, key = query_and_key.split_with_sizes((spec.num_heads, spec.num_kv_heads), dim=1)
        out = self.backend.forward(spec, query, key, value, kv_cache, metadata)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, spec.num_heads * spec.head_dim)))


class LlamaMLP(UsesLayerKernels):
    def __init__(
        self, config: ArchitectureConfig, quantizer: Quantizer, dtype: torch.dtype, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size // tp.size, config.mlp_bias
        self.gate_up_proj = MergedLinear(hidden, (inner, inner), bias, quantizer, dtype, _shard(tp, 0))
        self.down_proj = Linear(inner, hidden, bias, quantizer, dtype, _shard(tp, 1))
        self.tp = tp
        self.is_gelu = config.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.is_gelu:
            return self.tp.all_reduce(self.down_proj(self.layer_kernels.gelu_tanh_and_mul(gate_up)))
        return self.tp.all_reduce(self.down_proj(self.layer_kernels.silu_and_mul(gate_up)))


class LlamaDecoderLayer(FastModule):
    attention_class: ClassVar[type[LlamaAttention]] = LlamaAttention
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(
        self,
        config: ArchitectureConfig,
        layer_index: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        quantizer: Quantizer,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
        mlp: nn.Module | None = None,
    ) -> None:
        """``mlp``: the feed-forward block in place of the dense ``LlamaMLP`` (a mixture of experts)."""
        super().__init__()
        self.self_attn = self.attention_class(config, layer_index, rotary, backend, quantizer, dtype, tp)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, quantizer, dtype, tp)
        self.input_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and the residual stream before it, whose sum is the next layer's input: each
        residual add happens in the norm after it, one kernel where the layer kernels fuse them. ``residual``
        is None in the first layer, whose ``hidden_states`` are the embeddings."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(FastModule):
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm
    layer_class: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    def __init__(
        self,
        config: ArchitectureConfig,
        backend: AttentionBackend,
        quantizer: Quantizer,
        dtype: torch.dtype,
        max_position: int,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_position)
        # Sliding-window layers with a rope of their own (Gemma 3's local base) share a second table.
        self.sliding_rotary = (
            RotaryEmbedding(config.sliding_rope, config.head_dim, max_position) if config.sliding_rope else None
        )
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(
            self.build_layer(config, i, backend, quantizer, dtype, tp) for i in range(config.num_layers)
        )
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype)

    def layer_rotary(self, config: ArchitectureConfig, layer_index: int) -> RotaryEmbedding:
        """The rope table layer ``layer_index`` rotates with."""
        if self.sliding_rotary is not None and config.sliding_windows[layer_index] is not None:
            return self.sliding_rotary
        return self.rotary

    def build_layer(
        self,
        config: ArchitectureConfig,
        layer_index: int,
        backend: AttentionBackend,
        quantizer: Quantizer,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
    ) -> nn.Module:
        """Decoder layer ``layer_index`` (a ``layer_class``); called once per layer by the constructor."""
        rotary = self.layer_rotary(config, layer_index)
        mlp = self.build_mlp(config, layer_index, quantizer, dtype, tp)
        return self.layer_class(config, layer_index, rotary, backend, quantizer, dtype, tp, mlp=mlp)

    def build_mlp(self, config: ArchitectureConfig, layer_index: int, *args: Any) -> nn.Module | None:
        """Layer ``layer_index``'s feed-forward block when it is not the dense ``LlamaMLP`` (None); called by
        ``build_layer`` with ``(config, layer_index, quantizer, dtype, tp)``."""
        return None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input for ``input_ids`` [num_tokens]: [num_tokens, hidden]."""
        return self.embed_tokens(input_ids)


class LlamaForCausalLM(CausalLM):
    supports_tensor_parallel: ClassVar[bool] = True
    #: The decoder stack a subclass builds instead.
    model_class: ClassVar[type[LlamaModel]] = LlamaModel
    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(
        self,
        config: ArchitectureConfig,
        backend: AttentionBackend,
        quantizer: Quantizer,
        dtype: torch.dtype,
        max_position: int | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.tp = tp = tp if tp is not None else single_process_group()
        max_position = max_position or config.max_position_embeddings
        self.model = self.model_class(config, backend, quantizer, dtype, max_position, tp)
        # A tied, dense output projection reads the embedding itself; otherwise it is a Linear of its
        # own (a quantized copy of a tied embedding costs its quantized size and saves reading the
        # float embedding every step: a fifth of SmolLM2-135M's weights).
        head_quantizer = quantizer.output_quantizer()
        self.head_quantizer = head_quantizer
        self.lm_head = (
            None
            if config.tie_word_embeddings and head_quantizer.is_dense
            else Linear(config.hidden_size, config.vocab_size // tp.size, False, head_quantizer, dtype, _shard(tp, 0))
        )  # each shard computes the logits of its part of the vocabulary (the embedding's rows, when tied)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        model = self.model
        hidden_states = model.embed(input_ids)  # [num_tokens, hidden]
        model.rotary.set_positions(positions)
        if model.sliding_rotary is not None:
            model.sliding_rotary.set_positions(positions)
        if self.fused_decoder is not None:
            fused = self.fused_decoder(hidden_states, kv_caches, metadata)
            if fused is not None:
                return fused
        residual = None
        for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, metadata)
        assert residual is not None, "a model has at least one layer"
        return model.norm(hidden_states, residual)[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # a dense quantizer multiplies by the embedding module's ``weight`` (no bias)
            logits = self.head_quantizer.apply(self.model.embed_tokens, hidden_states).float()
        else:
            logits = self.lm_head(hidden_states).float()
        cap = self.config.final_logits_soft_cap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return self.tp.gather_last_dim(logits)  # [num_selected, vocab] on rank 0

    def skip_checkpoint_tensor(self, name: str) -> bool:
        return name == "lm_head.weight" and self.config.tie_word_embeddings

    def checkpoint_aliases(self, name: str) -> tuple[str, ...]:
        tied_copy = name == "model.embed_tokens.weight" and self.config.tie_word_embeddings
        return ("lm_head.weight",) if tied_copy and self.lm_head is not None else ()
