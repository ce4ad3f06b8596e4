"""The ``cpu`` layer kernels' fused decoder: a Llama-shaped model's layers in one C++ call a step.

At one token, the default model's 30 layers call about 300 kernels of a few microseconds each, and the Python
between them (module calls, views, the plugins' wrappers) cost about 1.3 ms of a 6.6 ms step on a 2-vCPU Xeon
(docs/benchmarks.md, "The CPU decoder stack"). The layer kernels extension's ``decoder_stack`` runs the same kernels
in the same order from C++, so a step's hidden states are the layers' own, bit for bit.

It takes the models it reproduces exactly and leaves the rest to the layers (``CpuLayerKernels.fused_decoder``
returns None): ``LlamaForCausalLM`` built of Llama's own layer, attention, MLP (SiLU) and RMSNorm classes (Llama,
Mistral, Qwen2, Qwen3's q/k norms, SmolLM; not Gemma, Phi-3's partial rope or the mixtures of experts), one shard,
float32, every linear ``int4`` or ``int8``, and the ``cpu`` attention backend. With LoRA adapters under the ``cpu``
LoRA kernels, each linear adds the step's adapter products in C++ as ``LinearLoRA`` does after the matmul (other
LoRA kernels leave the steps that use an adapter to the layers). A step runs the layers when it holds a draft tree
or a prompt chunk long enough for SDPA, or when a forward hook is registered on any of the model's modules (the
quantize pipeline's calibration, a user's probe).
"""

from __future__ import annotations

from operator import attrgetter, is_not, methodcaller
from typing import Any, cast

import torch
from tokenmill_kernels.layer_kernels import cpu as layer_kernels
from tokenmill_kernels.paged_attention import cpu as paged_attention
from tokenmill_kernels.quant_matmul import cpu as quant_matmul
from torch import nn
from torch.nn.modules import module as torch_module

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.layers.kernels import FusedDecoder, LayerKernels
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.quantizer import layer_bias
from tokenmill.lora.layers import LoRAContext
from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from tokenmill_plugins.attention.cpu_backend import CpuAttentionBackend
from tokenmill_plugins.lora_kernels.cpu_kernels import BoundCpuLoRA
from tokenmill_plugins.quant.weight_only import Int4Quantizer, Int8Quantizer


def fused_decoder(model: nn.Module, attention: AttentionBackend, kernels: LayerKernels) -> FusedDecoder | None:
    """A ``CpuFusedDecoder`` for ``model`` when it runs every one of its layers as the layers would, else None."""
    if not (type(model) is LlamaForCausalLM and type(attention) is CpuAttentionBackend):
        return None
    if model.tp.size != 1 or model.model.sliding_rotary is not None or not _kernels_available():
        return None
    rotary = model.model.rotary
    if rotary.rotary_dim != rotary.head_dim:
        return None
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (
            type(layer) is LlamaDecoderLayer
            and type(attn) is LlamaAttention
            and type(mlp) is LlamaMLP
            and not mlp.is_gelu
            and (attn.q_norm is None) == (attn.k_norm is None)
            and all(type(norm) is RMSNorm for norm in (layer.input_layernorm, layer.post_attention_layernorm))
        ):
            return None
    if any(getattr(m, "layer_kernels", kernels) is not kernels for m in model.modules()):
        return None
    linears = _linears(model)
    if not {type(linear.quantizer) for linear in linears} <= {Int4Quantizer, Int8Quantizer}:
        return None
    if any(_weight_only(linear).max_kernel_rows is not None for linear in linears):  # F.linear above some rows
        return None
    qk_norms = _qk_norms(model)
    if qk_norms and len(qk_norms) != 2 * len(model.model.layers):
        return None
    if not all(type(norm) is RMSNorm for norm in (model.model.norm, *qk_norms)):
        return None
    if len({norm.eps for norm in (*_norms(model), *qk_norms)}) != 1:
        return None
    return CpuFusedDecoder(model, linears)


_lora, _quantizer, _buffers = attrgetter("lora"), attrgetter("quantizer"), attrgetter("_buffers")
_qweight = methodcaller("get", "qweight")


def _weight_only(linear: Linear) -> Int4Quantizer | Int8Quantizer:
    assert isinstance(linear.quantizer, Int4Quantizer | Int8Quantizer), "checked by fused_decoder"
    return linear.quantizer


def _kernels_available() -> bool:
    return all(k.is_available() for k in (layer_kernels, paged_attention, quant_matmul))


def _linears(model: Any) -> list[Linear]:
    """Each layer's qkv, o, gate_up and down projections, in the order the C++ stack takes them."""
    return [
        linear
        for layer in model.model.layers
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]


def _norms(model: Any) -> list[RMSNorm]:
    """Each layer's input and post-attention norms, then the final norm."""
    layers = model.model.layers
    return [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)] + [model.model.norm]


def _qk_norms(model: Any) -> list[RMSNorm]:
    """Each layer's q and k norms (Qwen3), or none."""
    attention = [layer.self_attn for layer in model.model.layers]
    return [n for attn in attention if attn.q_norm is not None for n in (attn.q_norm, attn.k_norm)]


class CpuFusedDecoder(FusedDecoder):
    """Runs ``model``'s layers and final norm through the layer kernels' ``decoder_stack``. Its C++ stack holds the
    linears' tensors as they were on the first step; it is built again on a step that finds any of them replaced
    (weights loaded again), a linear's quantizer changed or adapter slots attached, and a quantizer other than
    ``int4``/``int8`` leaves the steps to the layers."""

    def __init__(self, model: Any, linears: list[Linear]) -> None:
        """``linears``: ``_linears(model)``."""
        self.model = model
        self._linears = linears
        self._stack: Any = None
        self._built_from: list[object] = []  # _linears_now() at the build
        #: The adapted linears' step layout (one, for a Llama), and whether the stack adds their products.
        self._lora_contexts: list[LoRAContext] = []
        self._lora_in_stack = False
        # Each module's hook dicts (torch adds to them, never replaces them): any() over them runs in C.
        modules = [m for m in model.modules() if m is not model]
        self._hooks = [m._forward_hooks for m in modules] + [m._forward_pre_hooks for m in modules]

    def __call__(
        self, hidden_states: torch.Tensor, kv_caches: list[torch.Tensor], metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        state = metadata.backend_state
        if metadata.draft_tree is not None or state is None or state.long_chunks or self._needs_modules(hidden_states):
            return None
        linears_now = self._linears_now()
        if len(linears_now) != len(self._built_from) or any(map(is_not, linears_now, self._built_from)):
            self._stack, self._built_from = self._build(), linears_now  # the first step, or something replaced
        if self._stack is None:
            return None
        lora_plan = None
        if self._lora_contexts and any(context.batch is not None for context in self._lora_contexts):
            if not self._lora_in_stack:  # a token uses an adapter the stack cannot add
                return None
            lora_plan = getattr(self._lora_contexts[0].batch, "plan", None)
            if lora_plan is None:
                return None
        cos, sin = self.model.model.rotary.step_tables()
        return self._stack.forward(hidden_states, cos, sin, kv_caches, metadata.slot_mapping, state.block_tables,
                                   state.token_req, metadata.positions, lora_plan)  # fmt: skip

    def _needs_modules(self, hidden_states: torch.Tensor) -> bool:
        """Whether this step must run module by module: a forward hook anywhere (so that it runs), tracing,
        gradients, or another dtype. Attribute reads only: this runs every step."""
        if (
            hidden_states.dtype != torch.float32
            or hidden_states.requires_grad
            or torch_module._global_forward_hooks
            or torch_module._global_forward_pre_hooks
            or torch._C._get_tracing_state()
        ):
            return True
        return any(self._hooks)

    def _linears_now(self) -> list[object]:
        """Each linear's quantizer, the tensor first in its storage (``qweight``, for int4 and int8; None for
        others: the weights loaded again replace it), then its adapter slots (attached after the model loaded).
        Read in C."""
        linears = self._linears
        return [*map(_quantizer, linears), *map(_qweight, map(_buffers, linears)), *map(_lora, linears)]

    def _build(self) -> Any:
        """The C++ stack over the linears' tensors as they are now; None where one is not ``int4``/``int8``."""
        if not all(isinstance(linear.quantizer, Int4Quantizer | Int8Quantizer) for linear in self._linears):
            return None
        tensors = []
        for linear in self._linears:
            storage: list[torch.Tensor | None] = [linear._buffers[name] for name in _weight_only(linear).storage_names]
            if len(storage) == 2:  # int8: no mins
                storage.append(None)
            tensors.append([*storage, layer_bias(linear)])
        norms = _norms(self.model)
        specs = [layer.self_attn.spec for layer in self.model.model.layers]
        attention = [
            (s.num_heads, s.num_kv_heads, s.head_dim, s.scale, s.sliding_window or 0, s.logits_soft_cap or 0.0)
            for s in specs
        ]
        loras = [linear.lora for linear in self._linears]
        self._lora_contexts = list({id(lora.context): lora.context for lora in loras if lora is not None}.values())
        # The ``cpu`` LoRA kernels' slots, added from C++ when one step layout serves every adapted linear.
        self._lora_in_stack = len(self._lora_contexts) == 1 and all(
            lora is None or isinstance(lora.bound, BoundCpuLoRA) for lora in loras
        )
        lora_weights = None
        if self._lora_in_stack:
            lora_weights = [None if lora is None else cast(BoundCpuLoRA, lora.bound).weights for lora in loras]
        qk_norms = [norm.weight for norm in _qk_norms(self.model)]
        return layer_kernels.decoder_stack(
            tensors, [norm.weight for norm in norms], attention, norms[0].eps, lora_weights, qk_norms
        )
