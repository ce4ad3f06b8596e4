"""Turning GGUF tensors into Hugging Face ones: names, dtypes, shapes and llama.cpp's q/k row order.

GGUF lists a tensor's dims innermost first, so ``[cols, rows]`` is a
``[rows, cols]`` matrix. F32/F16/BF16 keep their dtype; quantized types become
float32 through ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from gguf import GGMLQuantizationType, ReaderTensor

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
#: The Llama family's per-layer GGUF base names -> Hugging Face module names inside ``model.layers.{i}``.
LLAMA_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TENSOR_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<base>\w+)\.(?P<suffix>weight|bias)")

#: Output bytes dequantized per call: small enough to stay in cache and keep temporaries small.
_DEQUANT_CHUNK_BYTES = 1 << 20


def hf_tensor_name(gguf_name: str, layer_names: Mapping[str, str] = LLAMA_LAYER_NAMES) -> str | None:
    """The Hugging Face name of a GGUF tensor under an architecture's ``layer_names``, or None when it has none."""
    match = _TENSOR_NAME.fullmatch(gguf_name)
    if match is None:
        return None
    base, suffix, layer = match["base"], match["suffix"], match["layer"]
    if layer is None:
        hf_base = _GLOBAL_NAMES.get(base)
        return None if hf_base is None else f"{hf_base}.{suffix}"
    hf_base = layer_names.get(base)
    return None if hf_base is None else f"model.layers.{int(layer)}.{hf_base}.{suffix}"


def unpermute_qk_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation for the ``llama`` architecture.

    llama.cpp's rope rotates neighbouring pairs, Hugging Face's rotates the two
    halves of each head, so the converter stores Hugging Face row
    ``j * head_dim/2 + i`` of each head as row ``2*i + j``. Reading the rows as
    ``[heads, head_dim/2, 2]`` and swapping the last two axes restores them.
    Works for weights ``[rows, cols]`` and biases ``[rows]``.
    """
    rows = tensor.shape[0]
    assert rows % (2 * num_heads) == 0, (rows, num_heads)
    half = rows // num_heads // 2
    return tensor.reshape(num_heads, half, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def can_decode(tensor: ReaderTensor) -> bool:
    """Whether ``gguf`` can dequantize this tensor's type: tried on the tensor's first block."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    qtype = tensor.tensor_type
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        return True
    if qtype not in GGML_QUANT_SIZES or tensor.data.dtype.kind != "u":
        return False  # integer tensors (I8..I64, F64) are not weights
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(tensor.data.reshape(-1)[:type_size], qtype)
    except NotImplementedError:
        return False
    return True


def decode(tensor: ReaderTensor) -> torch.Tensor:
    """The tensor as torch, in Hugging Face shape; a copy, so nothing keeps the memory map alive.

    Raises ``ValueError``/``RuntimeError``/``NotImplementedError`` on data that does not decode.
    """
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType

    shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
    qtype = tensor.tensor_type
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        value = torch.from_numpy(np.array(tensor.data))
    elif qtype == GGMLQuantizationType.BF16:  # stored as raw bytes; numpy has no bfloat16
        value = torch.from_numpy(np.array(tensor.data).view(np.int16)).view(torch.bfloat16)
    else:
        value = _dequantize_by_chunks(tensor.data, qtype, num_cols=shape[-1])
    return value.reshape(shape)


def _dequantize_by_chunks(data: Any, qtype: GGMLQuantizationType, num_cols: int) -> torch.Tensor:
    """Dequantize ``data`` (uint8, ``[..., bytes_per_row]``) to float32 ``[rows, num_cols]``.

    ``gguf.quants.dequantize`` makes several float32 temporaries of its input's
    size; feeding it ~1 MiB of rows at a time keeps peak memory near the
    output's size (a 128k-token embedding would otherwise need GBs more).
    """
    import torch
    from gguf import dequantize

    rows = data.reshape(-1, data.shape[-1])
    out = torch.empty(rows.shape[0], num_cols, dtype=torch.float32)  # [rows, num_cols]
    out_np = out.numpy()
    step = max(1, _DEQUANT_CHUNK_BYTES // (num_cols * 4))
    for start in range(0, rows.shape[0], step):
        out_np[start : start + step] = dequantize(rows[start : start + step], qtype)
    return out
