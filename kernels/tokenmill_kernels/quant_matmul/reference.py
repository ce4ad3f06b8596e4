"""Plain-torch definition of the weight-only quantized matmul: formats, (de)quantization, and exact numerics.

This module is the specification the C++ kernels in ``cpu/quant_matmul.cpp`` are tested against, and it provides
the public quantize/dequantize functions (they run once at load time, so vectorised torch is fast enough).

Weights are ``[N, K]`` (out_features, in_features, as in ``nn.Linear``) and are quantized in groups of 32
consecutive elements along K, so K must be a positive multiple of 32. Group ``g`` of row ``n`` covers
``W[n, 32g:32g+32]``.

int8 (Q8_0 semantics), symmetric::

    qweight int8    [N, K]       q = clamp(round(w * (1 / d)), -127, 127), row-major, no reordering
    scales  float16 [N, K // 32] d = float16(absmax / 127); w ~= d * q

int4 (Q4_1 semantics), asymmetric::

    qweight uint8   [N, K // 2]  16 bytes per group; byte j of group g holds element 32g+j in its low nibble
                                 and element 32g+j+16 in its high nibble (GGUF's Q4_1 ``qs`` layout); rows are
                                 not reordered
    mins    float16 [N, K // 32] m = float16(min)
    scales  float16 [N, K // 32] d = float16(max(max - m, 0) / 15);  q = clamp(round((w - m) * (1 / d)), 0, 15);
                                 w ~= d * q + m

``float16(v)`` rounds to nearest-even, subnormals included, as GGUF stores ``d`` and ``m``; the codes are
computed from the rounded ``d`` and ``m`` (llama.cpp uses the unrounded ones), so they are the nearest for the
stored scale. Everything else is float32; ``round`` is round-half-to-even (``torch.round``) throughout, and a
zero scale gives ``q = 0``.

Range: a scale or min beyond float16's largest finite value (65504) raises ``ValueError``, as does a weight
that is not finite: for int8 that takes an absmax above about 8.3e6, for int4 a group min beyond +-65504 or a
range above about 9.8e5. Scales in float16's subnormal range (below 2**-14) keep fewer significant bits, as in
GGUF, and one below 2**-25 (int8: absmax below about 3.8e-6) rounds to ``d = 0``, so that group's codes are 0.

Why float16: it halves the scales' share of the memory traffic against float32 (int4 reads 20 bytes per group
instead of 24), and it is GGUF's format. With an 11-bit ``d``, ``d * q`` is exact in float32, so a quantized
block survives dequantize -> quantize unchanged as long as it uses its extreme codes (some ``|q| = 127`` for
Q8_0; both 0 and 15 for Q4_1) and ``d * q + m`` is exact in float32. GGUF Q8_0/Q4_1 blocks from llama.cpp's
plain quantizers always use them, subnormal ``d`` included, and so does this module's output, except in groups
whose rounded scale lost enough bits among float16's subnormals, or (int4) whose min is so far from 0 that its
rounding moves it by half a step or more. The always-lossless route for a GGUF tensor is to take its blocks
directly, because these layouts are GGUF's: for Q8_0 ``qweight = qs`` (as int8) and ``scales = d``; for Q4_1
``qweight = qs`` (the 16 bytes of each block, concatenated per row), ``scales = d`` and ``mins = m``.

Matmul numerics (``matmul_int8`` / ``matmul_int4`` below; the kernels differ only by float32 summation order):
each activation row is quantized per 32-block to int16, symmetric, with a float32 scale::

    dx = absmax(x_block) / 32767 (float32);  ix = 1 / dx, or 0 when dx == 0
    qx = clamp(round(x * ix), -32767, 32767)   (int16)
    sx = dx * sum(qx)          (float32; the block sum of the *quantized* activations, used for Q4_1's min term)

and then, with integer block dot products ``dot_g = sum_j qw[n, g, j] * qx[m, g, j]``::

    int8: y[m, n] = sum_g dot_g * (dw[n, g] * dx[m, g])                       + bias[n]
    int4: y[m, n] = sum_g dot_g * (dw[n, g] * dx[m, g]) + mw[n, g] * sx[m, g] + bias[n]

where the float16 ``dw`` and ``mw`` are converted to float32 (exactly), and ``dw * dx`` is rounded to float32
before it multiplies ``dot_g``, as in the kernels.

Why int16, not int8 like llama.cpp's Q8_1: int8 activations flip near-tied greedy choices on the default model,
int16 stays within the float16 KV cache's own error, and on AVX-512 costs nothing more (a group's 32 codes fill one
512-bit register; docs/performance.md, "Accuracy of the quantized path"). Using the quantized block sum ``sx``
rather than the exact one keeps the error of a Q4_1 group
at ``sum_j w_j * (x_hat_j - x_j)``: with the exact sum it would be ``sum_j (w_j - m) * (x_hat_j - x_j)``, larger
since ``w - m`` spans the whole group range.
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP = 32
#: The largest activation code: activations are rounded to integers in [-ACT_MAX, ACT_MAX] (int16).
ACT_MAX = 32767

__all__ = [
    "ACT_MAX",
    "GROUP",
    "dequantize_int4",
    "dequantize_int8",
    "matmul_int4",
    "matmul_int8",
    "pack_int4_codes",
    "quantize_activations",
    "quantize_int4",
    "quantize_int8",
]


def _check_weight(weight: Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if weight.dtype != torch.float32:
        raise ValueError(f"weight must be float32, got {weight.dtype}")
    if weight.shape[1] == 0 or weight.shape[1] % GROUP != 0:
        raise ValueError(f"K (in_features) must be a positive multiple of {GROUP}, got {weight.shape[1]}")


def _to_float16(values: Tensor, what: str) -> Tensor:
    """``values`` rounded to float16 for storage; ``ValueError`` if any does not fit (or was not finite)."""
    rounded = values.to(torch.float16)
    bad = ~torch.isfinite(rounded)
    if bad.any():
        largest = values[bad].abs().max().item()
        raise ValueError(
            f"{what} is stored as float16, whose largest finite value is 65504, but a group of 32 needs "
            f"{largest:.4g}: the weight is too large (or not finite) for this format"
        )
    return rounded


def _reciprocal(scales: Tensor) -> Tensor:
    """``1 / scales``, or 0 where a scale is 0 (an all-zero or constant group), so that its codes come out 0.

    Multiplying by the reciprocal instead of dividing is still exact on re-quantization: ``(d * q) * (1 / d)``
    is within a relative 2**-24 of the integer ``q``, far from a rounding boundary.
    """
    return torch.where(scales > 0, 1.0 / torch.where(scales > 0, scales, torch.ones_like(scales)), 0.0)


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-32-group int8 (Q8_0 semantics): returns ``(qweight int8 [N, K], scales float16 [N, K//32])``.

    Raises ``ValueError`` if a scale does not fit float16 (see the module docstring).
    """
    _check_weight(weight)
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP, GROUP)
    low, high = torch.aminmax(groups, dim=-1)
    scales = _to_float16(torch.maximum(-low, high) / 127.0, "the int8 scale absmax / 127")  # [N, K // 32]
    q = (groups * _reciprocal(scales.float()).unsqueeze(-1)).round_().clamp_(-127, 127)
    return q.to(torch.int8).reshape(n, k), scales


def dequantize_int8(qweight: Tensor, scales: Tensor) -> Tensor:
    """Inverse of :func:`quantize_int8`'s layout: ``float32 [N, K]`` with ``w = d * q``."""
    n, k = qweight.shape
    groups = qweight.reshape(n, k // GROUP, GROUP).to(torch.float32)
    return (groups * scales.float().unsqueeze(-1)).reshape(n, k)


def pack_int4_codes(q: Tensor) -> Tensor:
    """``uint8 [N, K]`` codes in 0..15 -> the int4 layout's ``qweight`` ``uint8 [N, K//2]``: per group of 32,
    byte j = q[j] | q[j + 16] << 4. For weights quantized elsewhere (GPTQ, AWQ), whose scales and mins are known."""
    return _pack_nibbles(q)


def _pack_nibbles(q: Tensor) -> Tensor:
    """``uint8 [N, K]`` codes in 0..15 -> ``uint8 [N, K//2]``: per group, byte j = q[j] | q[j + 16] << 4."""
    n, k = q.shape
    halves = q.reshape(n, k // GROUP, 2, GROUP // 2)
    return (halves[:, :, 0, :] | (halves[:, :, 1, :] << 4)).reshape(n, k // 2)


def _unpack_nibbles(qweight: Tensor) -> Tensor:
    """Inverse of :func:`_pack_nibbles`: ``uint8 [N, K//2]`` -> codes ``uint8 [N, K]``."""
    n, half_k = qweight.shape
    groups = qweight.reshape(n, half_k // (GROUP // 2), 1, GROUP // 2)
    return torch.cat([groups & 0x0F, groups >> 4], dim=2).reshape(n, half_k * 2)


def quantize_int4(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric per-32-group 4-bit (Q4_1 semantics).

    Returns ``(qweight uint8 [N, K//2], scales float16 [N, K//32], mins float16 [N, K//32])``; see the module
    docstring for the nibble layout. Raises ``ValueError`` if a scale or min does not fit float16.
    """
    _check_weight(weight)
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP, GROUP)
    low, high = torch.aminmax(groups, dim=-1)
    mins = _to_float16(low, "the int4 min")  # [N, K // 32]
    # The stored min, not the true one, so that d * 15 + m reaches the group's max; a min that rounded above
    # the max (a constant group) gives d = 0 rather than a negative scale.
    scales = _to_float16((high - mins.float()).clamp_(min=0.0) / 15.0, "the int4 scale (max - min) / 15")
    q = groups - mins.float().unsqueeze(-1)
    q = q.mul_(_reciprocal(scales.float()).unsqueeze(-1)).round_().clamp_(0, 15)
    return _pack_nibbles(q.to(torch.uint8).reshape(n, k)), scales, mins


def dequantize_int4(qweight: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """Inverse of :func:`quantize_int4`'s layout: ``float32 [N, K]`` with ``w = d * q + m``."""
    codes = _unpack_nibbles(qweight)
    n, k = codes.shape
    groups = codes.reshape(n, k // GROUP, GROUP).to(torch.float32)
    return (groups * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)).reshape(n, k)


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-32-block int16 quantization of activations ``x float32 [M, K]``, as done inside the kernels.

    Returns ``(qx int16 [M, K], dx float32 [M, K//32], sx float32 [M, K//32])`` with ``sx = dx * sum(qx)``.
    """
    m, k = x.shape
    blocks = x.reshape(m, k // GROUP, GROUP)
    dx = blocks.abs().amax(dim=-1) / ACT_MAX
    qx = torch.round(blocks * _reciprocal(dx).unsqueeze(-1)).clamp_(-ACT_MAX, ACT_MAX)
    sx = qx.sum(dim=-1) * dx  # |sum(qx)| <= 32 * 32767 < 2**24: exact in float32
    return qx.to(torch.int16).reshape(m, k), dx, sx


def _block_dots(qx: Tensor, qw: Tensor) -> Tensor:
    """Exact integer dot products per block: ``[M, K] x [N, K] -> float64 [M, N, K//32]``."""
    m, k = qx.shape
    n = qw.shape[0]
    a = qx.reshape(m, k // GROUP, GROUP).to(torch.float64)
    b = qw.reshape(n, k // GROUP, GROUP).to(torch.float64)
    # Products of int16 activation and int8 weight codes summed over 32 elements stay below 2**28, far below
    # 2**53, so float64 is exact here.
    return torch.einsum("mgj,ngj->mng", a, b)


def _finish(out: Tensor, bias: Tensor | None) -> Tensor:
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.to(torch.float32)


def matmul_int8(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """Reference ``x @ dequantize_int8(qweight, scales).T + bias`` with int16-quantized activations, in float64."""
    qx, dx, _ = quantize_activations(x)
    dots = _block_dots(qx, qweight)
    scale = (scales.float().unsqueeze(0) * dx.unsqueeze(1)).to(torch.float64)  # [M, N, G], rounded to float32
    return _finish((dots * scale).sum(dim=-1), bias)


def matmul_int4(x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor, bias: Tensor | None = None) -> Tensor:
    """Reference ``x @ dequantize_int4(qweight, scales, mins).T + bias`` with int16-quantized activations."""
    qx, dx, sx = quantize_activations(x)
    dots = _block_dots(qx, _unpack_nibbles(qweight))
    scale = (scales.float().unsqueeze(0) * dx.unsqueeze(1)).to(torch.float64)  # [M, N, G]
    min_term = sx.to(torch.float64) @ mins.to(torch.float64).T
    return _finish((dots * scale).sum(dim=-1) + min_term, bias)
