"""Write tiny transformers models as GGUF files, the way llama.cpp's converter does.

Test-only. The tensor names come from ``gguf.get_tensor_name_map`` (the
converter's own table) and the metadata keys from ``gguf.GGUFWriter``, so the
files do not depend on tokenmill's loader: they are what ``convert_hf_to_gguf.py``
would write for the same checkpoint, minus a real tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

#: transformers ``model_type`` -> GGUF ``general.architecture``.
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_PERMUTED_ARCHS = {"llama"}


def permute_like_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: rows of each head go from [2, d/2] to [d/2, 2] order."""
    head_rows = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, head_rows, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _encode(array: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """Quantize like the converter: 1-D tensors stay F32, rows that do not fit a block fall back to F16."""
    if array.ndim == 1 or qtype == GGMLQuantizationType.F32:
        return array.astype(np.float32), GGMLQuantizationType.F32
    if qtype == GGMLQuantizationType.F16:
        return array.astype(np.float16), GGMLQuantizationType.F16
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    if array.shape[-1] % block_size != 0:
        return array.astype(np.float16), GGMLQuantizationType.F16
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def _add_tokenizer(writer: gguf.GGUFWriter, vocab_size: int, config: Any) -> None:
    # A minimal byte-level BPE vocabulary: enough for transformers' GGUF config parsing.
    tokens = [f"<t{i}>" for i in range(vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([int(gguf.TokenType.NORMAL)] * vocab_size)
    writer.add_token_merges([])
    if getattr(config, "bos_token_id", None) is not None:
        writer.add_bos_token_id(config.bos_token_id)
    if getattr(config, "eos_token_id", None) is not None:
        writer.add_eos_token_id(config.eos_token_id)


def _add_hparams(writer: gguf.GGUFWriter, config: Any, arch: str) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_name("tiny-test-model")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "head_dim", None) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        writer.add_sliding_window(config.sliding_window)


def write_llama_gguf(
    model_or_state_dict: torch.nn.Module | dict[str, torch.Tensor],
    hf_config: Any,
    path: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    extra_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> Path:
    """Write a Llama-family transformers checkpoint to ``path`` as llama.cpp's converter would.

    :param model_or_state_dict: the model, or its ``state_dict()``.
    :param hf_config: its transformers config (``model_type`` llama, mistral, qwen2 or qwen3).
    :param qtype: type for 2-D tensors; 1-D tensors (norms, biases) are always F32.
    :param extra_tensors: raw GGUF tensors to append, ``name -> (data, type)``; quantized
        data is given as uint8 bytes of shape ``[rows, bytes_per_row]``.
    """
    state_dict = (
        model_or_state_dict.state_dict() if isinstance(model_or_state_dict, torch.nn.Module) else model_or_state_dict
    )
    arch = GGUF_ARCH[hf_config.model_type]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], hf_config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, arch)
    _add_hparams(writer, hf_config, arch)
    _add_tokenizer(writer, hf_config.vocab_size, hf_config)
    writer.add_file_type(int(qtype) if qtype != GGMLQuantizationType.F32 else 0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    for hf_name, tensor in state_dict.items():
        if hf_name == "lm_head.weight" and hf_config.tie_word_embeddings:
            continue  # the converter drops the tied copy
        array = tensor.detach().to(torch.float32).numpy()
        if arch in _PERMUTED_ARCHS:
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                array = permute_like_llama_cpp(array, hf_config.num_attention_heads)
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                array = permute_like_llama_cpp(array, hf_config.num_key_value_heads)
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        data, data_type = _encode(array, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=data_type)
    for name, (data, data_type) in (extra_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=data_type)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_block_bytes(qtype: GGMLQuantizationType, shape: tuple[int, int], seed: int) -> np.ndarray:
    """Random but valid quantized data for a ``[rows, cols]`` tensor, as uint8 ``[rows, bytes_per_row]``.

    Quant bytes are uniform; every fp16 scale in a block is replaced with a small
    finite value so that dequantizing yields no inf/nan.
    """
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    assert cols % block_size == 0
    num_blocks = rows * cols // block_size
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for offset in _FP16_SCALE_OFFSETS[qtype](type_size):
        scale = rng.uniform(-0.05, 0.05, size=(num_blocks, 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8)
    return blocks.reshape(rows, cols // block_size * type_size)


# Byte offsets of the fp16 scales inside one block of each type (ggml-common.h).
_FP16_SCALE_OFFSETS: dict[GGMLQuantizationType, Any] = {
    GGMLQuantizationType.Q4_0: lambda size: [0],  # d, qs[16]
    GGMLQuantizationType.Q4_1: lambda size: [0, 2],  # d, m, qs[16]
    GGMLQuantizationType.Q8_0: lambda size: [0],  # d, qs[32]
    GGMLQuantizationType.Q4_K: lambda size: [0, 2],  # d, dmin, scales[12], qs[128]
    GGMLQuantizationType.Q6_K: lambda size: [size - 2],  # ql[128], qh[64], scales[16], d
}


def write_raw_gguf(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]],
    arch: str = "llama",
    num_heads: int = 2,
    num_kv_heads: int = 1,
    extra_metadata: dict[str, Any] | None = None,
) -> Path:
    """Write a GGUF with the given raw tensors and just enough metadata for the loader.

    Quantized data is given as uint8 ``[rows, bytes_per_row]``; the writer turns
    the byte shape back into the element shape.
    """
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(256)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    for key, value in (extra_metadata or {}).items():
        writer.add_key_value(key, value[0], value[1])
    for name, (data, data_type) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=data_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_freqs(head_dim: int, theta: float, factor: float) -> np.ndarray:
    """The ``rope_freqs.weight`` llama.cpp's converter writes for ``llama3`` rope scaling.

    A transcription of ``LlamaModel.generate_extra_tensors`` in convert_hf_to_gguf.py,
    which always uses low_freq_factor 1, high_freq_factor 4 and an original context of 8192.
    """
    import math

    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_freq_factor, high_freq_factor, old_context_len = 1.0, 4.0, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors: list[float] = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def requantize_gguf(source: Path, path: Path, qtype: GGMLQuantizationType) -> Path:
    """Copy a float GGUF file with its block matrices (and stacked experts) quantized to ``qtype``, as
    ``llama-quantize`` does: norms, biases and the router stay float; the metadata is copied as it is."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(path, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if tensor.name.startswith("blk.") and data.ndim >= 2 and "ffn_gate_inp" not in tensor.name:
            writer.add_tensor(tensor.name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
