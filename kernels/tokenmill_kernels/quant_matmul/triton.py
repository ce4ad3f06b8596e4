"""Triton kernel for weight-only quantized matmul on the GPU (W4A16 and W8A16), with its launcher.

``y = x @ W.T + bias`` for ``x`` ``[M, K]`` in float16, bfloat16 or float32, where ``W`` ``[N, K]`` is stored as
integer codes with a scale and an offset per group of inputs::

    W[n, k] = codes[n, k] * scales[g, n] + mins[g, n],   g = k // group_size

(a format's ``(q - zero) * scale`` is ``q * scale + mins`` with ``mins = -zero * scale``). The layout, made once at
load by :func:`pack_int_weight` (the GPTQ layout, read the same way by GPTQ's Triton kernels):

    qweight int32   [K * bits / 32, N]  32 / bits codes per word along K, lowest bits first: word ``[k // per_word,
                                        n]`` holds ``codes[n, k]`` in bits ``(k % per_word) * bits``; N is
                                        contiguous, so a tile's words load coalesced along N
    scales  float32 [K // group_size, N]
    mins    float32 [K // group_size, N]

``group_size`` is a multiple of 32 dividing K, or K itself (one scale per output channel). Activation order (GPTQ
``desc_act``) is a permutation of the inputs: the codes' columns are permuted at load so that each group is
contiguous, and :func:`dequant_matmul` gathers ``x``'s columns with the same ``perm`` once per call.

One program computes a ``BLOCK_M x BLOCK_N`` tile of ``y``. For each ``BLOCK_K`` slice of K (which lies in one
group, since ``BLOCK_K`` divides ``group_size``) it loads the ``x`` tile and the packed words, shifts and masks the
codes out, dequantizes them in float32 with the group's scale and min, rounds them to ``x``'s dtype and adds their
``tl.dot`` to a float32 accumulator. float32 inputs are multiplied in IEEE float32 (no TF32).

On a machine without a GPU the kernel runs under the Triton interpreter, chosen when the kernel is decorated:
``TRITON_INTERPRET=1`` must be in the environment before this module is imported (``is_interpreted`` tells).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "SUPPORTED_BITS",
    "SUPPORTED_DTYPES",
    "dequant_matmul",
    "dequantize_int_weight",
    "is_interpreted",
    "pack_int_weight",
]

SUPPORTED_BITS = (4, 8)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Group sizes are multiples of this (the kernel's smallest K slice).
_MIN_BLOCK_K = 32
#: ``tl.dot`` needs at least 16 rows on older Triton versions; fewer tokens are masked.
_MIN_DOT_ROWS = 16


def is_interpreted() -> bool:
    """Whether the kernel was decorated for the Triton interpreter (``TRITON_INTERPRET=1`` at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_dequant_matmul_kernel, InterpretedFunction)


# ---------------------------------------------------------------- kernel


@triton.jit
def _dequant_matmul_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    mins_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    stride_x,
    stride_out,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    n_valid = offs_n < N
    shifts = (offs_k % PER_WORD) * BITS  # [BLOCK_K]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        x = tl.load(x_rows + (k_start + offs_k)[None, :], mask=m_valid[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        word_rows = (k_start + offs_k) // PER_WORD
        words = tl.load(
            qweight_ptr + word_rows.to(tl.int64)[:, None] * N + offs_n[None, :], mask=n_valid[None, :], other=0
        )  # [BLOCK_K, BLOCK_N] int32, each word read by the PER_WORD rows it packs
        codes = (words >> shifts[:, None]) & MASK
        group = k_start // group_size  # BLOCK_K divides group_size: the slice lies in one group
        scale = tl.load(scales_ptr + group * N + offs_n, mask=n_valid, other=0.0)  # [BLOCK_N]
        low = tl.load(mins_ptr + group * N + offs_n, mask=n_valid, other=0.0)
        w = codes.to(tl.float32) * scale[None, :] + low[None, :]  # [BLOCK_K, BLOCK_N]
        # DOT_FP32: float32 must not fall back to TF32, and the interpreter multiplies bfloat16 operands
        # through float32 anyway.
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


# ---------------------------------------------------------------- layout (load time, plain torch)


def pack_int_weight(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``uint8 [N, K]`` codes in ``0 .. 2**bits - 1`` -> the kernel's ``qweight`` ``int32 [K * bits / 32, N]``."""
    _expect(bits in SUPPORTED_BITS, f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    n, k = codes.shape
    per_word = 32 // bits
    _expect(k % per_word == 0, f"K={k} is not a multiple of {per_word} ({bits}-bit codes per int32)")
    columns = codes.T.to(torch.int32).reshape(k // per_word, per_word, n)  # [K / per_word, per_word, N]
    words = torch.zeros(k // per_word, n, dtype=torch.int32, device=codes.device)
    for i in range(per_word):
        words |= columns[:, i] << (i * bits)  # int32 shifts wrap: the top code sets the sign bit
    return words


def dequantize_int_weight(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel's layout back to ``float32 [N, K]``: ``codes * scale + min`` per group (for tests and tools)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)  # [per_word]
    codes = (qweight.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)  # [K / per_word, per_word, N]
    codes = codes.reshape(qweight.shape[0] * per_word, -1).T.float()  # [N, K]
    group_size = codes.shape[1] // scales.shape[0]
    return codes * scales.T.repeat_interleave(group_size, dim=1) + mins.T.repeat_interleave(group_size, dim=1)


# ---------------------------------------------------------------- launcher


def _expect(condition: bool, message: str) -> None:
    """A launcher's argument check: raises instead of launching a kernel that would read out of bounds."""
    if not condition:
        raise ValueError(message)


def _dot_fp32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and is_interpreted())


def _block_k(group_size: int) -> int:
    return 64 if group_size % 64 == 0 else _MIN_BLOCK_K


def _block_m(num_tokens: int) -> int:
    return min(64, max(_MIN_DOT_ROWS, triton.next_power_of_2(num_tokens)))


def dequant_matmul(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K * bits / 32, N] int32
    scales: torch.Tensor,  # [K // group_size, N] float32
    mins: torch.Tensor,  # [K // group_size, N] float32
    bits: int,
    bias: torch.Tensor | None = None,  # [N]
    perm: torch.Tensor | None = None,  # [K] int64: x's columns in the weight's order (activation order)
) -> torch.Tensor:
    """``x[:, perm] @ W.T + bias`` for ``W`` in the kernel's layout (module docstring): ``[M, N]`` in ``x``'s dtype.

    Called by the checkpoint quantizers' ``apply`` on CUDA, once per linear per step, and by the kernel tests.
    The group size is ``K // scales.shape[0]``."""
    _expect(bits in SUPPORTED_BITS, f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    _expect(x.dim() == 2, f"x must be [num_tokens, in_features], got shape {tuple(x.shape)}")
    _expect(x.dtype in SUPPORTED_DTYPES, f"x dtype {x.dtype} is not one of {SUPPORTED_DTYPES}")
    num_tokens, k = x.shape
    per_word = 32 // bits
    _expect(
        qweight.dim() == 2 and qweight.dtype == torch.int32 and qweight.shape[0] * per_word == k,
        f"qweight must be int32 [K * {bits} / 32 = {k // per_word}, N], got {qweight.dtype} {tuple(qweight.shape)}",
    )
    n = qweight.shape[1]
    num_groups = scales.shape[0] if scales.dim() == 2 else 0
    _expect(
        num_groups > 0 and k % num_groups == 0,
        f"scales must be [num_groups, N] with num_groups dividing K={k}, got {tuple(scales.shape)}",
    )
    group_size = k // num_groups
    _expect(
        group_size % _MIN_BLOCK_K == 0,
        f"group size {group_size} (K={k} over {num_groups} groups) is not a multiple of {_MIN_BLOCK_K}",
    )
    for name, tensor in (("scales", scales), ("mins", mins)):
        _expect(
            tuple(tensor.shape) == (num_groups, n) and tensor.dtype == torch.float32,
            f"{name} must be float32 {[num_groups, n]}, got {tensor.dtype} {list(tensor.shape)}",
        )
    if bias is not None:
        _expect(tuple(bias.shape) == (n,), f"bias must have shape ({n},), got {tuple(bias.shape)}")
    if perm is not None:
        _expect(tuple(perm.shape) == (k,), f"perm must have shape ({k},), got {tuple(perm.shape)}")
        x = x.index_select(1, perm)
    x = x.contiguous()
    for name, operand in (("qweight", qweight), ("scales", scales), ("mins", mins), ("bias", bias)):
        if operand is not None:
            _expect(operand.device == x.device, f"{name} is on {operand.device}, x on {x.device}")
            _expect(operand.is_contiguous(), f"{name} must be contiguous")
    _expect(
        x.device.type == "cuda" or is_interpreted(),
        f"the Triton kernel on {x.device.type} needs TRITON_INTERPRET=1 set before tokenmill_kernels is imported",
    )
    out = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)  # [M, N]
    if num_tokens == 0 or n == 0:
        return out
    block_m, block_n = _block_m(num_tokens), 32 if num_tokens <= _MIN_DOT_ROWS else 64
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(n, block_n))
    _dequant_matmul_kernel[grid](
        x, qweight, scales, mins, bias if bias is not None else out, out,
        num_tokens, n, k, group_size, x.stride(0), out.stride(0),
        BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_block_k(group_size), HAS_BIAS=bias is not None,
        DOT_FP32=_dot_fp32(x.dtype), num_warps=4,
    )  # fmt: skip
    return out
