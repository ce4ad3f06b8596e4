"""The quantized KV cache formats: ``fp8`` (float8 e4m3) and ``int8``, one scale per token and KV head.

``cache.kv_cache_dtype = "fp8"`` (or ``"fp8_e4m3"``) stores ``torch.float8_e4m3fn`` codes and ``"int8"``
stores ``torch.int8`` codes. Each row (one token's key, or value, for one KV head) is quantized on its own,
symmetrically, from its absolute maximum (absmax)::

    scale = absmax(row) / QMAX          # QMAX: 448 for e4m3 (its largest finite value), 127 for int8
    code  = row / scale                 # fp8: rounded to nearest even by the float8 conversion
                                        # int8: rounded to nearest even, clamped to [-127, 127]
    row  ~= code * scale

The scale is a float32 stored right after the row's codes, in the same tensor: a quantized cache keeps the
default layout ``[2, num_blocks, block_size, num_kv_heads, head_dim + 4]`` in the code dtype, where the last
4 bytes of each row are its scale (little-endian float32). Blocks therefore carry their scales wherever they
go (copy-on-write, KV tiers, KV connectors), and a row costs ``head_dim + 4`` bytes against ``2 * head_dim``
in float16: 53% for head_dim 64, 52% for 128. An all-zero row (a freshly zeroed cache) has scale 0 and reads
as zeros. Attention backends read codes and scale and widen on the fly (see
``tokenmill_kernels.paged_attention``); this module is the plain-torch definition they are tested against.

Per-(token, head) dynamic scales are llama.cpp's q8_0 KV idea at row granularity: no calibration, and one
outlier only coarsens its own row (vLLM's fp8 cache uses one static scale per layer instead).
"""

from __future__ import annotations

import torch

__all__ = [
    "QUANTIZED_KV_DTYPES",
    "SCALE_BYTES",
    "dequantize_kv",
    "is_quantized_kv",
    "kv_row_size",
    "quantize_kv",
    "read_kv",
    "write_kv",
]

#: Cache dtypes stored as one-byte codes plus a float32 scale per row.
QUANTIZED_KV_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.int8)
#: Bytes of scale after each row's codes.
SCALE_BYTES = 4
#: The code a row's absolute maximum maps to.
_QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds codes with per-row scales (``fp8``, ``int8``)."""
    return dtype in _QMAX


def kv_row_size(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in one cached row of ``head_dim`` values: ``head_dim``, plus the scale's 4 bytes
    for a quantized dtype."""
    return head_dim + SCALE_BYTES if is_quantized_kv(dtype) else head_dim


def quantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` [..., head_dim] (any float dtype) -> [..., head_dim + 4] of ``dtype``: codes, then the float32
    scale's bytes. ``head_dim`` must be a multiple of 4 (every model's is)."""
    assert is_quantized_kv(dtype), dtype
    head_dim = rows.shape[-1]
    assert head_dim % SCALE_BYTES == 0, head_dim
    values = rows.float()
    # Divided by a tensor, not a Python number: CUDA divides by a host scalar as a multiplication by its
    # reciprocal, which rounds differently; this way every device, and the kernels (div_rn), agree to the bit.
    amax = values.abs().amax(dim=-1, keepdim=True)
    scale = amax / amax.new_tensor(_QMAX[dtype])  # [..., 1] float32
    scaled = values / torch.where(scale > 0, scale, 1.0)  # an all-zero row stays zero
    if dtype == torch.int8:
        codes = scaled.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        codes = scaled.to(dtype).view(torch.uint8)  # |scaled| <= 448: finite, rounded to nearest even
    packed = torch.cat([codes, scale.view(torch.uint8)], dim=-1)  # [..., head_dim + 4] bytes
    return packed.view(dtype)


def dequantize_kv(rows: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., head_dim + 4] codes and scales, as ``quantize_kv`` packs them -> [..., head_dim] of ``out_dtype``:
    code times scale, computed in float32."""
    assert is_quantized_kv(rows.dtype), rows.dtype
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].float() * scale).to(out_dtype)


def write_kv(cache_rows: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Store ``rows`` [n, num_kv_heads, head_dim] at ``slots`` [n] (int64) of ``cache_rows``
    [num_slots, num_kv_heads, row]: converted to the cache's dtype, or quantized with their scales."""
    if is_quantized_kv(cache_rows.dtype):
        # index_copy_ has no float8 kernel: copy the bytes.
        packed = quantize_kv(rows, cache_rows.dtype)  # [n, num_kv_heads, head_dim + 4]
        cache_rows.view(torch.uint8).index_copy_(0, slots, packed.view(torch.uint8))
    else:
        cache_rows.index_copy_(0, slots, rows.to(cache_rows.dtype))


def read_kv(cache_rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache, [..., row] -> [..., head_dim] of ``out_dtype``: widened, or dequantized."""
    if is_quantized_kv(cache_rows.dtype):
        return dequantize_kv(cache_rows, out_dtype)
    return cache_rows.to(out_dtype)
