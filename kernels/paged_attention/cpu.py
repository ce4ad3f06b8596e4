"""Launcher for the CPU paged-attention kernels in ``cpu/paged_attention.cpp`` (float32, AVX2).

``paged_attention`` computes, for every new token of a step, causal attention over its own
request's cached keys and values, read through the block table: decode tokens and prompt
chunks alike, with GQA and sliding windows. ``write_kv_cache`` stores a step's new keys and
values into their slots first.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from tokenmill.kernels.cpp_build import CppExtension

__all__ = ["is_available", "load", "paged_attention", "write_kv_cache"]

_EXTENSION = CppExtension(
    "tokenmill_paged_attention",
    Path(__file__).resolve().parent / "cpu" / "paged_attention.cpp",
    ["-O3", "-mavx2", "-mfma"],
    "CPU paged-attention kernels",
)
#: Limits of the kernel's per-thread scratch arrays.
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 16, 256, 256


def is_available() -> bool:
    """True when the CPU can run the kernels and the toolchain to build them is present."""
    return _EXTENSION.is_available()


def load() -> None:
    """Build (first use on a machine, ~30 s) or load the extension; raises ``RuntimeError`` naming
    what is missing. The launchers call it too; call it early to keep the build out of a step."""
    _EXTENSION.load()


def _check_cache(key_cache: Tensor, value_cache: Tensor) -> None:
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4 or cache.dtype != torch.float32 or not cache.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous float32 [num_blocks, block_size, kv_heads, head_dim] tensor, "
                f"got {cache.dtype} {tuple(cache.shape)}"
            )
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key and value caches differ: {tuple(key_cache.shape)} vs {tuple(value_cache.shape)}")
    if key_cache.shape[1] > MAX_BLOCK_SIZE or key_cache.shape[3] > MAX_HEAD_DIM or key_cache.shape[3] % 8:
        raise ValueError(
            f"block_size must be <= {MAX_BLOCK_SIZE} and head_dim a multiple of 8 up to {MAX_HEAD_DIM}, "
            f"got {key_cache.shape[1]} and {key_cache.shape[3]}"
        )


def write_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store ``key``/``value`` [num_tokens, kv_heads, head_dim] at ``slot_mapping`` [num_tokens] (int64)."""
    _check_cache(key_cache, value_cache)
    expected = (slot_mapping.shape[0], *key_cache.shape[2:])
    for name, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape) != expected or tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 {list(expected)}, got {tensor.dtype} {tensor.shape}")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    _EXTENSION.load().write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: Tensor,  # [num_tokens, heads, head_dim]
    key_cache: Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: Tensor,
    block_tables: Tensor,  # [num_reqs, max_blocks] int32
    token_req: Tensor,  # [num_tokens] int32
    positions: Tensor,  # [num_tokens] int64
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    """Attention of each token over its request's keys at positions ``<= positions[t]`` (and within
    ``sliding_window``); returns [num_tokens, heads, head_dim]. The cache must already hold them."""
    _check_cache(key_cache, value_cache)
    if query.dim() != 3 or query.dtype != torch.float32 or not query.is_contiguous():
        raise ValueError(f"query must be a contiguous float32 [num_tokens, heads, head_dim], got {query.shape}")
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    if query.shape[2] != key_cache.shape[3]:
        raise ValueError(f"query head_dim {query.shape[2]} != cache head_dim {key_cache.shape[3]}")
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"{num_heads} heads cannot share {num_kv_heads} kv heads (at most {MAX_GROUP} per kv head)")
    if block_tables.dtype != torch.int32 or token_req.dtype != torch.int32 or positions.dtype != torch.int64:
        raise ValueError("block_tables and token_req must be int32 and positions int64")
    if not (block_tables.is_contiguous() and token_req.is_contiguous() and positions.is_contiguous()):
        raise ValueError("block_tables, token_req and positions must be contiguous")
    if token_req.shape[0] != query.shape[0] or positions.shape[0] != query.shape[0]:
        raise ValueError("token_req and positions need one entry per query token")
    return _EXTENSION.load().paged_attention(
        query, key_cache, value_cache, block_tables, token_req, positions, scale, sliding_window or 0
    )
