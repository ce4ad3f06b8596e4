"""Launcher for the CPU paged-attention kernels in ``cpu/paged_attention.cpp`` (AVX2, F16C; AVX-512 where present).

``paged_attention`` computes, for every new token of a step, causal attention over its own
request's cached keys and values, read through the block table: decode tokens and prompt
chunks alike, with GQA and sliding windows. ``write_kv_cache`` stores a step's new keys and
values into their slots first. Queries, keys and values are float32; the cache is float32 or
float16 (rounded to nearest even on write, widened on read, so all arithmetic is float32), or
quantized: float8_e4m3fn or int8 codes with a float32 scale per (token, kv head) row stored after
the row's codes, so its last dimension is head_dim + 4 (``tokenmill.attention.kv_quant`` defines the
format: scale = absmax / 448 or / 127, codes rounded to nearest even). Quantized rows are
dequantized as they are read.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from tokenmill_kernels.cpp_build import CppExtension

__all__ = [
    "c_api",
    "is_available",
    "isa",
    "load",
    "paged_attention",
    "prepare",
    "set_isa",
    "supported_isas",
    "write_kv_cache",
]

_EXTENSION = CppExtension(
    "tokenmill_paged_attention",
    Path(__file__).resolve().parent / "cpu" / "paged_attention.cpp",
    ["-O3", "-mavx2", "-mfma", "-mf16c"],
    "CPU paged-attention kernels",
)


def is_available() -> bool:
    """True when the CPU can run the kernels and the toolchain to build them is present."""
    return _EXTENSION.is_available()


def prepare() -> None:
    """Start building (first use on a machine) or loading the extension in the background and return; the first
    call that needs it waits. Several extensions prepared together build side by side."""
    _EXTENSION.prepare()


def load() -> None:
    """Build (first use on a machine) or load the extension; raises ``RuntimeError`` naming
    what is missing. The launchers call it too; call it early to keep the build out of a step."""
    _EXTENSION.load()


def c_api() -> object:
    """The extension's C++ entry points for another extension's C++, in a capsule (``cpu_common/kernel_api.h``)."""
    return _EXTENSION.load().c_api()


def write_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store ``key``/``value`` [num_tokens, kv_heads, head_dim] at ``slot_mapping`` [num_tokens] (int64).

    Called once per layer per step: the compiled op checks every shape, dtype and contiguity and
    raises ``ValueError``; checking in C++ keeps the per-call cost down."""
    _EXTENSION.load().write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: Tensor,  # [num_tokens, heads, head_dim] float32
    key_cache: Tensor,  # [num_blocks, block_size, kv_heads, head_dim (+ 4 quantized)] float32/16, float8_e4m3fn, int8
    value_cache: Tensor,
    block_tables: Tensor,  # [num_reqs, max_blocks] int32
    token_req: Tensor,  # [num_tokens] int32
    positions: Tensor,  # [num_tokens] int64
    scale: float,
    sliding_window: int | None = None,
    tree_start: Tensor | None = None,  # [num_tokens] int64, -1 for a token outside any draft tree
    tree_bits: Tensor | None = None,  # [num_tokens] int64
    logits_soft_cap: float | None = None,
) -> Tensor:
    """Attention of each token over its request's keys at positions ``<= positions[t]`` (and within
    ``sliding_window``); returns [num_tokens, heads, head_dim]. The cache must already hold them. With
    ``logits_soft_cap``, the scaled scores pass through ``cap * tanh(score / cap)`` before the softmax.

    With ``tree_start`` and ``tree_bits`` (draft trees, ``tokenmill.speculative.draft_tree``): a token with
    ``tree_start[t] >= 0`` sees a key at position ``p >= tree_start[t]`` only when bit
    ``p - tree_start[t]`` of ``tree_bits[t]`` is set (itself and its ancestors; at most 64 nodes).

    Limits: head_dim a multiple of 8 up to 256, block_size a power of two up to 256, up to 16 query heads per kv
    head; the compiled op checks them with the shapes and raises ``ValueError``."""
    return _EXTENSION.load().paged_attention(
        query, key_cache, value_cache, block_tables, token_req, positions, scale, sliding_window or 0, tree_start,
        tree_bits, logits_soft_cap or 0.0,
    )  # fmt: skip


def supported_isas() -> list[str]:
    """The kernel variants this CPU can run, best last: ``"avx2"``, and ``"avx512"`` (the loops over head_dim
    on 512-bit vectors) where the CPU has AVX-512 F, BW, VL and DQ."""
    return _EXTENSION.supported_isas()


def isa() -> str:
    """The variant :func:`paged_attention` runs now (the best supported, unless :func:`set_isa` said otherwise)."""
    return _EXTENSION.isa()


def set_isa(name: str) -> None:
    """Use variant ``name`` (one of :func:`supported_isas`, or ``"auto"`` for the best) in this process from now on.

    For tests and benchmarks; the variants differ in float32 summation order only. ``ValueError`` names the
    supported ones."""
    _EXTENSION.set_isa(name)
