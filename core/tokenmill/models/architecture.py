"""``ArchitectureConfig``: a checkpoint's shape, normalised from its Hugging Face config.

Hugging Face configs spell the same thing several ways across model families
and transformers versions (``rope_theta`` + ``rope_scaling`` before v5,
``rope_parameters`` after; ``attention_bias`` meaning q/k/v/o for Llama but
Qwen2 always biasing q/k/v only). This module turns them into one flat,
explicit description that model code can read without knowing the family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.errors import TokenmillError


class ArchitectureError(TokenmillError, ValueError):
    """The checkpoint's config cannot be understood; the message names the field."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    scaling_type: str = "default"  # "default", "linear" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


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
    qk_norm: bool  # RMSNorm over each head of q and k before rope (Qwen3)
    sliding_windows: tuple[int | None, ...]  # per layer; None is full attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    #: How the checkpoint stores its linear layers when not as floats (a GGUF type name, ``"Q4_1"``).
    stored_weight_type: str | None = None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ArchitectureConfig:
        """Normalise a Hugging Face ``config.json`` dict."""
        architectures = hf.get("architectures") or []
        if not architectures:
            raise ArchitectureError("config has no 'architectures' entry; cannot choose the model class")
        model_type = str(hf.get("model_type", ""))
        num_heads = _required(hf, "num_attention_heads")
        hidden_size = _required(hf, "hidden_size")
        num_layers = _required(hf, "num_hidden_layers")
        head_dim = hf.get("head_dim") or hidden_size // num_heads
        attention_bias = bool(hf.get("attention_bias", False))
        is_qwen2 = model_type == "qwen2"
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=architectures[0],
            model_type=model_type,
            vocab_size=_required(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_required(hf, "intermediate_size"),
            num_layers=num_layers,
            num_attention_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_proj_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_windows=_sliding_windows(hf, model_type, num_layers),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            stored_weight_type=_stored_weight_type(hf.get("quantization_config")),
        )


def _required(hf: dict[str, Any], key: str) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or value <= 0:
        raise ArchitectureError(f"config field {key!r} must be a positive integer, got {value!r}")
    return value


def _rope_config(hf: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes rope_parameters; older configs write rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling_type = merged.get("rope_type") or merged.get("type") or "default"
    if scaling_type not in ("default", "linear", "llama3"):
        raise ArchitectureError(
            f"rope scaling type {scaling_type!r} is not supported (supported: default, linear, llama3)"
        )
    return RopeConfig(
        theta=theta,
        scaling_type=scaling_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


def _sliding_windows(hf: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types:  # transformers >= 4.53 states it per layer
        if len(layer_types) != num_layers:
            raise ArchitectureError(f"config layer_types has {len(layer_types)} entries for {num_layers} layers")
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if window is None:
        return (None,) * num_layers
    if model_type in ("qwen2", "qwen3"):
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
