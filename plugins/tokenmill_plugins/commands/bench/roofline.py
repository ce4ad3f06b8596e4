"""How close a decode step comes to the memory-bandwidth roofline.

A decode step of a small batch is bound by memory traffic: it reads every
weight once and each request's KV cache. So its floor is

    bytes per step = weight bytes + sum over requests of KV bytes(seq_len)

at the device's peak bandwidth, and the fraction of the roofline a run reaches
is ``bytes per step / step time / peak bandwidth``. Weight bytes are the
model's parameter count times the bytes of its dtype (a dense model; a
quantizer's smaller weights are not counted), less an untied input embedding
table, of which a step reads only its tokens' rows. ``bench decode``
reports it with ``--peak-bandwidth-gbs``, or on a GPU listed in
``KNOWN_PEAK_BANDWIDTH_GBS``. Pure arithmetic: no torch at import.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.errors import TokenmillError

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.models.architecture import ArchitectureConfig

logger = logging.getLogger(__name__)

#: Peak memory bandwidth in GB/s (10^9 bytes/s) by a substring of ``torch.cuda.get_device_name()``,
#: first match wins. The H100 SXM reports itself as "NVIDIA H100 80GB HBM3".
KNOWN_PEAK_BANDWIDTH_GBS: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 SXM", 3350.0),
    ("H100 80GB HBM3", 3350.0),
)

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


class RooflineError(TokenmillError):
    """The roofline needs a peak bandwidth this machine's GPU is not known for; pass --peak-bandwidth-gbs."""


@dataclass(frozen=True)
class Roofline:
    """One decode step's memory traffic against the peak bandwidth."""

    weight_bytes: int
    kv_bytes: int  # read by one step, over all requests
    step_time_s: float
    achieved_gbs: float  # (weight_bytes + kv_bytes) / step_time_s, in 10^9 bytes/s
    peak_bandwidth_gbs: float
    fraction: float  # achieved_gbs / peak_bandwidth_gbs


def known_peak_bandwidth_gbs(device_name: str) -> float | None:
    """The peak bandwidth of a GPU named ``device_name``, or None when it is not in the table."""
    for key, bandwidth in KNOWN_PEAK_BANDWIDTH_GBS:
        if key.lower() in device_name.lower():
            return bandwidth
    return None


#: Model types that normalise q and k over all heads at once (OLMo 2, through the transformers fallback).
_WHOLE_QK_NORM_MODEL_TYPES = frozenset({"olmo2", "olmoe"})
#: Model types whose layers normalise the attention and MLP outputs too.
_FOUR_NORM_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text"})


def _moe_mlp_parameters(arch: ArchitectureConfig, layer_index: int) -> int | None:
    """The parameters of a mixture-of-experts layer's feed-forward block (router, experts, a shared expert and its
    gate), or None for a dense layer; from the Hugging Face config as Qwen-MoE and Mixtral state it."""
    hf, hidden = arch.hf_config, arch.hidden_size
    num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    step = int(hf.get("decoder_sparse_step") or 1)
    if not num_experts or layer_index in (hf.get("mlp_only_layers") or ()) or (layer_index + 1) % step:
        return None
    expert_inner = int(hf.get("moe_intermediate_size") or arch.intermediate_size)
    shared_inner = int(hf.get("shared_expert_intermediate_size") or 0)
    shared = 3 * hidden * shared_inner + hidden if shared_inner else 0  # and its 1-output gate
    return num_experts * hidden + num_experts * 3 * hidden * expert_inner + shared


def count_parameters(arch: ArchitectureConfig) -> int:
    """The number of parameters of a Llama-family model, Gemma's (two more norms a layer), Phi-3's and the
    mixtures of experts' (every expert)."""
    hidden, inter, head_dim = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q_width, kv_width = arch.num_attention_heads * head_dim, arch.num_kv_heads * head_dim
    attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
    if arch.qkv_bias:
        attention += q_width + 2 * kv_width
    if arch.o_proj_bias:
        attention += hidden
    if arch.qk_norm:
        attention += 2 * head_dim
    if arch.model_type in _WHOLE_QK_NORM_MODEL_TYPES:  # q and k normalised over the whole projection
        attention += q_width + kv_width
    mlp = 3 * hidden * inter + ((2 * inter + hidden) if arch.mlp_bias else 0)
    norms = 4 if arch.model_type in _FOUR_NORM_MODEL_TYPES else 2  # Gemma 2/3 also norm each sublayer's output
    layers = 0
    for layer_index in range(arch.num_layers):
        moe = _moe_mlp_parameters(arch, layer_index)
        layers += attention + (mlp if moe is None else moe) + norms * hidden
    embeddings = arch.vocab_size * hidden * (1 if arch.tie_word_embeddings else 2)  # input table and lm_head
    return embeddings + layers + hidden  # the final norm


def kv_bytes_read(arch: ArchitectureConfig, seq_lens: Sequence[int], dtype_bytes: int) -> int:
    """Bytes of K and V one decode step reads for requests of these lengths (a sliding-window
    layer reads at most its window)."""
    per_token_per_layer = 2 * arch.num_kv_heads * arch.head_dim * dtype_bytes
    total = 0
    for window in arch.sliding_windows:
        total += sum(seq_len if window is None else min(seq_len, window) for seq_len in seq_lens)
    return total * per_token_per_layer


def decode_roofline(*, weight_bytes: int, kv_bytes: int, step_time_s: float, peak_bandwidth_gbs: float) -> Roofline:
    """The achieved bandwidth of a step that moved ``weight_bytes + kv_bytes`` in ``step_time_s``."""
    if step_time_s <= 0 or peak_bandwidth_gbs <= 0:
        raise ValueError(f"step time {step_time_s} s and peak bandwidth {peak_bandwidth_gbs} GB/s must be positive")
    achieved = (weight_bytes + kv_bytes) / step_time_s / 1e9
    return Roofline(weight_bytes, kv_bytes, step_time_s, achieved, peak_bandwidth_gbs, achieved / peak_bandwidth_gbs)


def weight_bytes_per_step(arch: ArchitectureConfig, dtype_bytes: int) -> int:
    """Bytes of weights one decode step reads: every parameter, except that an untied input embedding table
    is read only at the step's few token rows (counted as none); a tied one is the output projection, read whole."""
    untied_input_table = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    return (count_parameters(arch) - untied_input_table) * dtype_bytes


def decode_step_roofline(
    arch: ArchitectureConfig,
    *,
    dtype: str,
    input_len: int,
    output_len: int,
    step_time_s: float,
    peak_bandwidth_gbs: float,
    batch_size: int = 1,
) -> Roofline:
    """The roofline of a decode step of ``batch_size`` streams: the weights once, and each stream's KV at its
    mean length over the steps (``input_len + 1`` to ``input_len + output_len - 1`` tokens already cached)."""
    dtype_bytes = DTYPE_BYTES[dtype]
    mean_seq_len = input_len + output_len // 2
    return decode_roofline(
        weight_bytes=weight_bytes_per_step(arch, dtype_bytes),
        kv_bytes=kv_bytes_read(arch, [mean_seq_len] * batch_size, dtype_bytes),
        step_time_s=step_time_s,
        peak_bandwidth_gbs=peak_bandwidth_gbs,
    )


def read_architecture(config: EngineConfig) -> ArchitectureConfig:
    """The configured model's architecture, read from its files' metadata (no tensors are loaded)."""
    from tokenmill.model_files import resolve_model
    from tokenmill.model_loader import select_weight_format
    from tokenmill.models.architecture import ArchitectureConfig
    from tokenmill.plugin_manager import load_plugins

    path = resolve_model(config.model.model)
    plugins = load_plugins(disabled=config.disable_plugins)
    weight_format = select_weight_format(path, plugins, config.model.weight_format)
    return ArchitectureConfig.from_hf_config(weight_format.read_config(path))


def resolve_peak_bandwidth_gbs(peak_bandwidth_gbs: float | None, device: str) -> float | None:
    """The bandwidth to compare with: the given one, else the known GPU's on CUDA, else None on CPU.

    Raises ``RooflineError`` on a GPU missing from ``KNOWN_PEAK_BANDWIDTH_GBS`` without the flag.
    """
    if peak_bandwidth_gbs is not None or device != "cuda":
        return peak_bandwidth_gbs
    import torch

    name = torch.cuda.get_device_name()
    known = known_peak_bandwidth_gbs(name)
    if known is None:
        raise RooflineError(f"the peak memory bandwidth of {name!r} is not known: pass --peak-bandwidth-gbs")
    logger.info("peak bandwidth of %s: %.0f GB/s", name, known)
    return known
