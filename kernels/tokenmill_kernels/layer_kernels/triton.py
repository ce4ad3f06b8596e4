"""Triton kernels for the operations between a layer's matmuls, with their launchers.

- ``rms_norm``: one program per row; with a residual, the row's sum ``x + residual`` is rounded to the
  row's dtype, stored as the new residual, and normalised, so the add costs no kernel of its own.
- ``silu_and_mul``: one program per (row, block of the inner size): ``silu(gate) * up``.
- ``rotary``: one program per token rotates all its query and key heads in place.

They round where ``tokenmill.layers.kernels.TorchLayerKernels`` rounds: sums, norms and activations are
computed in float32 and rounded to the tensor's dtype at the same points as the torch operations, so
results differ from the reference only by the order of the float32 sum of squares (and fused
multiply-adds).

On a machine without a GPU the kernels run under the Triton interpreter, which is chosen when the kernels
are decorated: ``TRITON_INTERPRET=1`` must be in the environment before this module is imported
(``is_interpreted`` tells).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["is_interpreted", "rms_norm", "rotary", "silu_and_mul"]


def is_interpreted() -> bool:
    """Whether these kernels were decorated for the Triton interpreter (``TRITON_INTERPRET=1`` at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_rms_norm_kernel, InterpretedFunction)


def _num_warps(block: int) -> int:
    """Enough warps for a block of ``block`` elements at about 8 per thread, between 1 and 16."""
    return max(1, min(16, block // 256))


# ---------------------------------------------------------------- kernels


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    x_stride, residual_stride, out_stride, residual_out_stride,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, ROUND_NORMED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # torch's add in x's dtype
        tl.store(residual_out_ptr + row * residual_out_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ROUND_NORMED:  # bf16/fp16: the normalised row is rounded to x's dtype before the scale, as in HF models
        out = (xf * rstd).to(x.dtype).to(tl.float32) * weight
    else:
        out = xf * rstd * weight
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + inner + cols, mask=mask, other=0.0)
    gate_f = gate.to(tl.float32)
    activated = (gate_f / (1.0 + tl.exp(-gate_f))).to(gate.dtype)  # F.silu, rounded to the dtype
    out = activated.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr,
    x_token_stride, x_head_stride, cos_stride, sin_stride,
    num_heads, half,
    BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]
    cols = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    col_mask = cols < half
    mask = (heads < num_heads) & col_mask
    first = x_ptr + token * x_token_stride + heads * x_head_stride + cols
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    cos = tl.load(cos_ptr + token * cos_stride + cols, mask=col_mask, other=0.0)
    sin = tl.load(sin_ptr + token * sin_stride + cols, mask=col_mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(first + half, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


# ---------------------------------------------------------------- launchers


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as rows [n, last dim] with a contiguous last dimension (a copy only where a view cannot be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of ``x`` [..., hidden] (of ``x + residual`` when given) scaled by ``weight`` [hidden].

    Returns the norm, shaped like ``x``, and the sum ``x + residual`` (None without a residual)."""
    hidden = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    residual_rows = residual_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, x.shape, residual.dtype)
        residual_rows = _rows(residual)
        residual_out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.view(x.shape), None if residual_out is None else residual_out.view(x.shape)
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, residual_rows if residual_rows is not None else rows, weight, out,
        residual_out if residual_out is not None else out,
        rows.stride(0), residual_rows.stride(0) if residual_rows is not None else 0, out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0,
        hidden, eps,
        HAS_RESIDUAL=residual is not None, ROUND_NORMED=x.dtype != torch.float32, BLOCK=block,
        num_warps=_num_warps(block),
    )  # fmt: skip
    return out.view(x.shape), None if residual_out is None else residual_out.view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [num_tokens, 2 * inner] (gate first); [num_tokens, inner]."""
    rows = _rows(gate_up)
    inner = rows.shape[-1] // 2
    out = torch.empty((rows.shape[0], inner), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(inner))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inner, block))](
        rows, out, rows.stride(0), out.stride(0), inner, BLOCK=block, num_warps=_num_warps(block)
    )
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope ("rotate half") in place on ``x`` [num_tokens, heads, head_dim] (last dimension contiguous; any
    token and head strides), with float32 ``cos`` and ``sin`` [num_tokens, 1, head_dim // 2] (last dimension
    contiguous). Returns ``x``."""
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1, "last dimensions must be contiguous"
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape[-1] == head_dim // 2, (cos.dtype, cos.shape)
    if num_tokens == 0:
        return x
    half = head_dim // 2
    block_heads, block_half = triton.next_power_of_2(num_heads), triton.next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), num_heads, half,
        BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, num_warps=_num_warps(block_heads * block_half * 2),
    )  # fmt: skip
    return x
