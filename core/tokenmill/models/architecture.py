"""``ArchitectureConfig``: a checkpoint's shape, normalised from its Hugging Face config.

Hugging Face configs spell the same thing several ways across model families
and transformers versions (``rope_theta`` + ``rope_scaling`` before v5,
``rope_parameters`` after; ``attention_bias`` meaning q/k/v/o for Llama but
Qwen2 always biasing q/k/v only). This module turns them into one flat,
explicit description that model code can read without knowing the family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tokenmill.errors import TokenmillError

_T = TypeVar("_T")


class ArchitectureError(TokenmillError, ValueError):
    """The checkpoint's config cannot be understood; the message names the field."""


#: Rope scaling types ``inverse_frequencies`` implements (``"su"`` is Phi-3's first name for ``"longrope"``).
ROPE_SCALING_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    scaling_type: str = "default"  # one of ROPE_SCALING_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 and longrope
    #: The share of each head that rotates (Phi-4-mini: 0.75); the rest passes through.
    partial_rotary_factor: float = 1.0
    #: longrope: per-frequency divisors below ``original_max_position_embeddings`` and from it on.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    #: longrope: cos and sin are multiplied by it (None: from the context extension, as transformers does).
    attention_factor: float | None = None


@dataclass(frozen=True)
class ArchitectureConfig:
    architecture: str  # registered architecture name, e.g. "LlamaForCausalLM"
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool  # bias on the output projection
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over each head of q and k before rope (Qwen3, Gemma 3)
    sliding_windows: tuple[int | None, ...]  # per layer; None is full attention
    #: Attention scores pass through ``cap * tanh(score / cap)`` (Gemma 2); the attention backend must
    #: support it (``AttentionBackend.supports_logits_soft_cap``).
    attention_logits_soft_cap: float | None = None
    #: Rope of the sliding-window layers where it differs from ``rope`` (Gemma 3's local base).
    sliding_rope: RopeConfig | None = None
    #: The logits pass through ``cap * tanh(logit / cap)`` (Gemma 2).
    final_logits_soft_cap: float | None = None
    #: The MLP's activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, Gemma).
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    #: How the checkpoint stores its linear layers when not as floats (a GGUF type name, ``"Q4_1"``).
    stored_weight_type: str | None = None
    #: The Hugging Face config as read, for the keys only one family has (an architecture plugin reads them).
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], lenient: bool = False) -> ArchitectureConfig:
        """Normalise a Hugging Face ``config.json`` dict.

        :param lenient: take defaults for what only tokenmill's own layers need (a rope scaling or activation
            they lack), for a model that runs its own layers (the transformers fallback).
        """
        architectures = hf.get("architectures") or []
        if not architectures:
            raise ArchitectureError("config has no 'architectures' entry; cannot choose the model class")
        model_type = str(hf.get("model_type", ""))
        num_heads = _required(hf, "num_attention_heads")
        hidden_size = _required(hf, "hidden_size")
        num_layers = _required(hf, "num_hidden_layers")
        head_dim = hf.get("head_dim") or hidden_size // num_heads
        attention_bias = bool(hf.get("attention_bias", False))
        is_qwen2 = model_type in ("qwen2", "qwen2_moe")  # q/k/v biased, o not
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=architectures[0],
            model_type=model_type,
            vocab_size=_required(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_intermediate_size(hf),
            num_layers=num_layers,
            num_attention_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_lenient(lambda: _rope_config(hf, "full_attention"), RopeConfig(), lenient),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_proj_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type in _QK_NORM_MODEL_TYPES,
            sliding_windows=_sliding_windows(hf, model_type, num_layers),
            attention_logits_soft_cap=_optional_float(hf, "attn_logit_softcapping"),
            sliding_rope=_lenient(lambda: _sliding_rope(hf), None, lenient),
            final_logits_soft_cap=_optional_float(hf, "final_logit_softcapping"),
            hidden_act=_lenient(lambda: _hidden_act(hf), "silu", lenient),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            stored_weight_type=_stored_weight_type(hf.get("quantization_config")),
            hf_config=dict(hf),
        )


def _lenient(read: Callable[[], _T], default: _T, lenient: bool) -> _T:
    try:
        return read()
    except ArchitectureError:
        if not lenient:
            raise
        return default


def _required(hf: dict[str, Any], key: str) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or value <= 0:
        raise ArchitectureError(f"config field {key!r} must be a positive integer, got {value!r}")
    return value


#: Model types whose attention normalises each head of q and k before rope.
_QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text"})
#: Hugging Face activation names -> the MLP activations the models implement.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _hidden_act(hf: dict[str, Any]) -> str:
    name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if hf.get("model_type") == "gemma" and name == "gelu":  # Gemma 1 configs say gelu and mean the tanh one
        name = "gelu_pytorch_tanh"
    if name not in _ACTIVATIONS:
        raise ArchitectureError(f"hidden_act {name!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def _intermediate_size(hf: dict[str, Any]) -> int:
    """The dense MLP's width; a model whose every layer is a mixture of experts may state only the experts'."""
    if "intermediate_size" not in hf and "moe_intermediate_size" in hf:
        return _required(hf, "moe_intermediate_size")
    return _required(hf, "intermediate_size")


def _optional_float(hf: dict[str, Any], key: str) -> float | None:
    value = hf.get(key)
    return None if value is None else float(value)


def _rope_parameters(hf: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """One layer type's rope parameters, merged from every spelling: transformers >= 5 writes
    ``rope_parameters`` (per layer type where the types differ, Gemma 3), older configs ``rope_theta`` +
    ``rope_scaling`` (+ ``partial_rotary_factor``, ``original_max_position_embeddings`` at the top level)."""
    params = dict(hf.get("rope_parameters") or {})
    if layer_type in params or "full_attention" in params:  # per layer type
        params = dict(params.get(layer_type) or params.get("full_attention") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged: dict[str, Any] = {**scaling, **params}
    merged.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if key not in merged and hf.get(key) is not None:
            merged[key] = hf[key]
    return merged


def _rope_config(hf: dict[str, Any], layer_type: str) -> RopeConfig:
    merged = _rope_parameters(hf, layer_type)
    scaling_type = merged.get("rope_type") or merged.get("type") or "default"
    scaling_type = "longrope" if scaling_type == "su" else scaling_type
    if scaling_type not in ROPE_SCALING_TYPES:
        raise ArchitectureError(
            f"rope scaling type {scaling_type!r} is not supported (supported: {', '.join(ROPE_SCALING_TYPES)})"
        )
    original = int(merged.get("original_max_position_embeddings", 8192))
    factor = merged.get("factor")
    if factor is None and scaling_type == "longrope":  # Phi-3: the ratio of the extended and original contexts
        factor = int(hf.get("max_position_embeddings", original)) / original
    attention_factor = merged.get("attention_factor")
    return RopeConfig(
        theta=float(merged["rope_theta"]),
        scaling_type=scaling_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        partial_rotary_factor=float(merged.get("partial_rotary_factor") or 1.0),
        short_factor=tuple(float(f) for f in merged.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in merged.get("long_factor") or ()),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )


def _sliding_rope(hf: dict[str, Any]) -> RopeConfig | None:
    """Gemma 3's rope for its sliding-window layers: ``rope_parameters["sliding_attention"]`` (transformers >= 5)
    or ``rope_local_base_freq`` (before), without the global layers' scaling."""
    params = hf.get("rope_parameters") or {}
    if "sliding_attention" in params:
        return _rope_config(hf, "sliding_attention")
    if hf.get("rope_local_base_freq") is not None:
        return RopeConfig(theta=float(hf["rope_local_base_freq"]))
    return None


def _sliding_windows(hf: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types:  # transformers >= 4.53 states it per layer
        if len(layer_types) != num_layers:
            raise ArchitectureError(f"config layer_types has {len(layer_types)} entries for {num_layers} layers")
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if window is None:
        return (None,) * num_layers
    if model_type == "gemma2":  # before layer_types: every even layer slides
        return tuple(window if i % 2 == 0 else None for i in range(num_layers))
    if model_type in ("gemma3", "gemma3_text"):  # before layer_types: every sliding_window_pattern-th is global
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        # Qwen only slides when asked to, and then from layer max_window_layers on.
        if not hf.get("use_sliding_window", False):
            return (None,) * num_layers
        first = int(hf.get("max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers  # Mistral: every layer


def _stored_weight_type(quantization_config: Any) -> str | None:
    """A GGUF weight format's block type (``quantization_config.weight_type``); None for anything else, including
    a malformed entry, which the model loader reports."""
    if isinstance(quantization_config, dict) and isinstance(quantization_config.get("weight_type"), str):
        return str(quantization_config["weight_type"])
    return None
