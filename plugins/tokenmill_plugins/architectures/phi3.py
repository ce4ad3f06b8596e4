"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): the Llama family with fused checkpoint projections.

Their checkpoints store q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (llama.cpp's converter
writes ``attn_qkv`` and a double-height ``ffn_up``). The model holds them as the Llama family's merged linears, so
each fused tensor is cut into its parts at load and tensor parallelism splits them by head as usual. Partial
rotary (Phi-4-mini) and LongRoPE (``longrope``/``su``) are ``RopeConfig``'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.weights.format import LoadedTensor, WeightsError


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, tensors: Iterable[LoadedTensor]) -> None:
        super().load_weights(self._split_fused(tensors))

    def _split_fused(self, tensors: Iterable[LoadedTensor]) -> Iterator[LoadedTensor]:
        config = self.config
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        parts = {
            "self_attn.qkv_proj": (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)),
            "mlp.gate_up_proj": (("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size)),
        }
        for item in tensors:
            module, _, param = item.name.rpartition(".")
            parent, _, fused = module.rpartition(".")
            layout = parts.get(f"{parent.rpartition('.')[2]}.{fused}")
            if layout is None:
                yield item
                continue
            if param not in ("weight", "bias"):
                raise WeightsError(
                    f"{item.file}: tensor {item.name!r}: fused projections are split only from float weights; "
                    "this quantized format stores them fused"
                )
            sizes = [size for _, size in layout]
            if item.tensor.shape[0] != sum(sizes):
                raise WeightsError(
                    f"{item.file}: tensor {item.name!r} has {item.tensor.shape[0]} rows, expected {sum(sizes)}"
                )
            for (name, _), piece in zip(layout, item.tensor.split(sizes), strict=True):
                yield LoadedTensor(f"{parent}.{name}.{param}", piece, item.file)
