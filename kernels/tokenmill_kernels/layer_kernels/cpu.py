"""Launcher for the CPU layer kernels in ``cpu/layer_kernels.cpp`` (AVX2, FMA), float32 only.

``rms_norm`` normalises rows, after adding the residual when given (returning the sum too); ``rotary`` applies
rope in place on a strided [tokens, heads, head_dim] view; ``silu_and_mul`` is SiLU of a row's first half times
its second. One pass each, where torch runs several operators.

``decoder_stack`` runs a Llama-shaped model's whole decoder stack in one call: these kernels with the
``quant_matmul`` and ``paged_attention`` extensions' own C++ (and the ``lora`` extension's, with adapters), lent
through their ``c_api()`` tables (``cpu_common/kernel_api.h``), in the order the Python forward calls them, so the
result is the forward's bit for bit without a Python call between the kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from tokenmill_kernels.cpp_build import CppExtension

__all__ = ["decoder_stack", "is_available", "load", "prepare", "rms_norm", "rotary", "silu_and_mul"]

_EXTENSION = CppExtension(
    "tokenmill_layer_kernels",
    Path(__file__).resolve().parent / "cpu" / "layer_kernels.cpp",
    ["-O3", "-mavx2", "-mfma"],
    "CPU layer kernels",
)


def is_available() -> bool:
    """True when the CPU can run the kernels and the toolchain to build them is present."""
    return _EXTENSION.is_available()


def prepare() -> None:
    """Start building (first use on a machine) or loading the extension in the background and return; the first
    call that needs it waits. Several extensions prepared together build side by side."""
    _EXTENSION.prepare()


def load() -> None:
    """Build (first use on a machine) or load the extension; raises ``RuntimeError`` naming what is missing."""
    _EXTENSION.load()


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """RMSNorm of ``x`` [..., hidden] (of ``x + residual`` when given) scaled by ``weight`` [hidden], float32.

    Returns the norm, shaped like ``x``, and the sum ``x + residual`` (None without a residual). The compiled op
    checks shapes, dtypes and strides and raises ``ValueError``. Rows [tokens, hidden] (a layer's hidden states)
    go as they are: reshaping and viewing would cost more than the norm (about 1 us a call each)."""
    extension = _EXTENSION.load()
    if x.dim() != 2:  # q/k norms over [tokens, heads, head_dim]
        out, total = rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, None if residual is None else
                              residual.reshape(-1, x.shape[-1]))  # fmt: skip
        return out.view(x.shape), None if total is None else total.view(x.shape)
    if residual is None:
        return extension.rms_norm(x, weight, eps)[0], None
    out, total = extension.rms_norm(x, weight, eps, residual)
    return out, total


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rope in place on ``x`` [tokens, heads, head_dim] (last dimension contiguous) with ``cos`` and ``sin``
    [tokens, 1, head_dim // 2]; returns ``x``."""
    _EXTENSION.load().rotary(x, cos, sin)
    return x


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``gate_up`` [tokens, 2 * inner] (rows contiguous) holding gate then up ->
    [tokens, inner]. The exponential is a vectorised polynomial within 2 ulp of exact."""
    return _EXTENSION.load().silu_and_mul(gate_up)


def decoder_stack(
    linears: Sequence[Sequence[Tensor | None]],
    norms: Sequence[Tensor],
    attention: Sequence[tuple[int, int, int, float, int, float]],
    eps: float,
    lora_weights: Sequence[Any] | None = None,
    qk_norms: Sequence[Tensor] = (),
) -> Any:
    """A decoder stack of ``len(attention)`` Llama layers in C++, checked once (``ValueError``).

    ``linears`` holds each layer's qkv (q, k and v merged: [heads + 2 * kv_heads] x head_dim outputs), o, gate_up
    (gate then up) and down projections in that order, each as the quantized matmuls take it: ``[qweight, scales,
    mins, bias]``, ``mins`` None for int8 and ``bias`` None without one; ``norms`` each layer's input and
    post-attention RMSNorm weights [hidden] float32, then the final norm's; ``attention`` each layer's
    ``(num_heads, num_kv_heads, head_dim, scale, sliding_window or 0, logits_soft_cap or 0.0)``; ``eps`` the norms'
    epsilon. The tensors must keep their storage. ``lora_weights``, with LoRA: each linear's adapter slots in the
    same order, as ``lora.cpu.weights`` made them (None for a linear without adapters). ``qk_norms``, for Qwen3's
    per-head norms of queries and keys before rope: each layer's q and k norm weights [head_dim] float32.

    Its ``forward(hidden, cos, sin, kv_caches, slot_mapping, block_tables, token_req, positions, lora_plan=None)``
    takes the embeddings [tokens, hidden] float32, the step's rope ``cos``/``sin`` [tokens, 1, head_dim // 2], each
    layer's KV cache [2, num_blocks, block_size, kv_heads, row] and the step's paged-attention inputs as
    ``paged_attention.cpu.paged_attention`` and ``write_kv_cache`` take them, and returns the final norm of the last
    layer's output [tokens, hidden]. With ``lora_plan`` (``lora.cpu.plan`` of the step's token slots), each linear
    adds its tokens' adapter products to its output, as ``Weights.add`` does after the matmul in the layers."""
    from tokenmill_kernels.paged_attention import cpu as paged_attention
    from tokenmill_kernels.quant_matmul import cpu as quant_matmul

    lora_api = None
    if lora_weights is not None:
        from tokenmill_kernels.lora import cpu as lora

        lora_api = lora.c_api()
    return _EXTENSION.load().DecoderStack(
        [list(parts) for parts in linears], list(norms), list(attention), eps, paged_attention.c_api(),
        quant_matmul.c_api(), list(lora_weights or ()), lora_api, list(qk_norms),
    )  # fmt: skip
