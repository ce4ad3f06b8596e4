"""llama.cpp's architectures as Hugging Face ones: one table per family.

Each ``GGUFArchitecture`` says how a file written by llama.cpp's converter
(``convert_hf_to_gguf.py``) maps back to the checkpoint it read: the Hugging
Face class, the per-layer tensor names, what the converter changed in the
tensors (q/k row order, Gemma's norms) and the config keys the family adds
to the Llama family's. Where the converter drops a value, the config takes
what llama.cpp itself assumes when it runs the file (``src/models/*.cpp``), so
the model tokenmill builds is the one llama.cpp runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenmill.weights.gguf_tensors import LLAMA_LAYER_NAMES

#: A metadata key without its ``{arch}.`` prefix -> its value, or None when the file lacks it.
Getter = Callable[[str], Any]
#: ``(get, config)`` -> the config keys a family adds to the Llama family's ``config``.
ConfigExtras = Callable[[Getter, dict[str, Any]], dict[str, Any]]

#: ``{expert}`` in a name marks a tensor that llama.cpp stacks over the experts ([num_experts, rows, cols]).
EXPERT = "{expert}"


def _no_extras(get: Getter, config: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one llama.cpp architecture maps to a Hugging Face one."""

    model_type: str
    hf_class: str
    #: Per-layer GGUF base names -> Hugging Face module names inside ``model.layers.{i}``.
    layer_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_LAYER_NAMES)
    #: The converter permutes q/k rows for llama.cpp's rope (its ``llama`` architecture only).
    permutes_qk: bool = False
    #: The converter stores norm weights plus this (Gemma's norms scale by ``1 + weight``: it folds the 1 in).
    norm_offset: float = 0.0
    extras: ConfigExtras = _no_extras


def _experts(get: Getter) -> tuple[int, int]:
    num_experts, top_k = get("expert_count"), get("expert_used_count")
    if not num_experts or not top_k:
        raise ValueError("a mixture of experts needs metadata keys expert_count and expert_used_count")
    return int(num_experts), int(top_k)


def _qwen_moe(norm_topk_prob: bool) -> ConfigExtras:
    """Qwen2-MoE and Qwen3-MoE. llama.cpp makes every layer sparse and fixes whether the top-k weights are
    renormalised per architecture (``norm_topk_prob``: Qwen2-MoE no, Qwen3-MoE yes); the converter stores neither."""

    def extras(get: Getter, config: dict[str, Any]) -> dict[str, Any]:
        num_experts, top_k = _experts(get)
        moe: dict[str, Any] = {
            "num_experts": num_experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(get("expert_feed_forward_length") or config["intermediate_size"]),
            "norm_topk_prob": norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
        shared = get("expert_shared_feed_forward_length")
        if shared:
            moe["shared_expert_intermediate_size"] = int(shared)
        return moe

    return extras


def _olmoe(get: Getter, config: dict[str, Any]) -> dict[str, Any]:
    """OLMoE. llama.cpp never renormalises its top-k weights, nor clips q/k/v (the converter drops ``clip_qkv``);
    each expert's width is ``feed_forward_length``, as OLMoE's config says."""
    num_experts, top_k = _experts(get)
    return {"num_experts": num_experts, "num_experts_per_tok": top_k, "norm_topk_prob": False}


def _mixtral(get: Getter, config: dict[str, Any]) -> dict[str, Any]:
    num_experts, top_k = _experts(get)  # feed_forward_length is each expert's width, as Mixtral's config says
    return {"num_local_experts": num_experts, "num_experts_per_tok": top_k}


def _layer_types(get: Getter, num_layers: int, default_pattern: int) -> list[str]:
    """Which layers slide: ``attention.sliding_window_pattern`` (a flag per layer, or every n-th layer global),
    else llama.cpp's fixed pattern for the architecture (Gemma 2: every 2nd layer global, Gemma 3: every 6th)."""
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        is_sliding = [bool(flag) for flag in pattern[:num_layers]]
    else:
        n = int(pattern or default_pattern)
        is_sliding = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    return ["sliding_attention" if sliding else "full_attention" for sliding in is_sliding]


def _query_pre_attn_scalar(config: dict[str, Any], num_layers_27b: int) -> int:
    """Not stored: llama.cpp scales queries by ``hidden / heads`` for the 27B model (told by its layer count) and
    by ``head_dim`` otherwise, which is what each Gemma release's config says."""
    if config["num_hidden_layers"] == num_layers_27b:
        return int(config["hidden_size"] // config["num_attention_heads"])
    return int(config["head_dim"])


def _gemma2(get: Getter, config: dict[str, Any]) -> dict[str, Any]:
    num_layers = config["num_hidden_layers"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _query_pre_attn_scalar(config, num_layers_27b=46),
        # llama.cpp's defaults where a key is absent
        "attn_logit_softcapping": float(get("attn_logit_softcapping") or 50.0),
        "final_logit_softcapping": float(get("final_logit_softcapping") or 30.0),
        "sliding_window": int(get("attention.sliding_window") or 4096),
        "layer_types": _layer_types(get, num_layers, 2),
    }


def _gemma3(get: Getter, config: dict[str, Any]) -> dict[str, Any]:
    num_layers = config["num_hidden_layers"]
    gemma: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _query_pre_attn_scalar(config, num_layers_27b=62),
        "final_logit_softcapping": get("final_logit_softcapping"),
    }
    if get("attention.sliding_window"):
        # The sliding layers rotate with their own base and no scaling (the global layers' rope_scaling).
        gemma["layer_types"] = _layer_types(get, num_layers, 6)
        gemma["rope_local_base_freq"] = float(get("rope.freq_base_swa") or 10000.0)
    else:
        gemma["layer_types"] = ["full_attention"] * num_layers
    return gemma


#: The Llama family's base names, with Gemma's four norms per layer: llama.cpp's ``ffn_norm`` is the MLP's input
#: norm, as in Llama, but Gemma calls it ``pre_feedforward_layernorm``.
_GEMMA_NAMES = {
    **LLAMA_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
#: Phi-3 keeps its fused projections: q/k/v in ``attn_qkv``, gate and up in a double-height ``ffn_up``.
_PHI3_NAMES = {
    **{base: name for base, name in LLAMA_LAYER_NAMES.items() if base not in ("ffn_up", "ffn_gate")},
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_QWEN_MOE_NAMES = {
    **LLAMA_LAYER_NAMES,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": f"mlp.experts.{EXPERT}.gate_proj",
    "ffn_up_exps": f"mlp.experts.{EXPERT}.up_proj",
    "ffn_down_exps": f"mlp.experts.{EXPERT}.down_proj",
    # Qwen2-MoE's shared expert and its sigmoid gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_MIXTRAL_NAMES = {
    **LLAMA_LAYER_NAMES,
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": f"block_sparse_moe.experts.{EXPERT}.w1",
    "ffn_up_exps": f"block_sparse_moe.experts.{EXPERT}.w3",
    "ffn_down_exps": f"block_sparse_moe.experts.{EXPERT}.w2",
}

#: GGUF ``general.architecture`` -> its Hugging Face architecture.
#: GGUF "llama" also carries Mistral models (their weights and rope are Llama's) and Mixtral (``MIXTRAL``).
ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("llama", "LlamaForCausalLM", permutes_qk=True),
    "mistral": GGUFArchitecture("mistral", "MistralForCausalLM", permutes_qk=True),
    "qwen2": GGUFArchitecture("qwen2", "Qwen2ForCausalLM"),
    "qwen3": GGUFArchitecture("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": GGUFArchitecture("qwen2_moe", "Qwen2MoeForCausalLM", _QWEN_MOE_NAMES, extras=_qwen_moe(False)),
    "qwen3moe": GGUFArchitecture("qwen3_moe", "Qwen3MoeForCausalLM", _QWEN_MOE_NAMES, extras=_qwen_moe(True)),
    "olmoe": GGUFArchitecture("olmoe", "OlmoeForCausalLM", _QWEN_MOE_NAMES, extras=_olmoe),
    "gemma2": GGUFArchitecture("gemma2", "Gemma2ForCausalLM", _GEMMA_NAMES, norm_offset=1.0, extras=_gemma2),
    "gemma3": GGUFArchitecture("gemma3_text", "Gemma3ForCausalLM", _GEMMA_NAMES, norm_offset=1.0, extras=_gemma3),
    "phi3": GGUFArchitecture("phi3", "Phi3ForCausalLM", _PHI3_NAMES),
}
#: llama.cpp writes Mixtral as ``llama`` with expert tensors (and ``llama.expert_count``).
MIXTRAL = GGUFArchitecture("mixtral", "MixtralForCausalLM", _MIXTRAL_NAMES, permutes_qk=True, extras=_mixtral)

#: Every Hugging Face architecture a GGUF file can hold (``tokenmill plugins``' GGUF column).
HF_ARCHITECTURES = frozenset({spec.hf_class for spec in ARCHITECTURES.values()} | {MIXTRAL.hf_class})


def gguf_architecture(arch: str, get: Getter) -> GGUFArchitecture | None:
    """The table for GGUF architecture ``arch`` (``get`` reads the file's ``{arch}.*`` keys); None if unsupported."""
    if arch == "llama" and get("expert_count"):
        return MIXTRAL
    return ARCHITECTURES.get(arch)
