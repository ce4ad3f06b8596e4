"""Triton LoRA kernels for the GPU, with their launcher: Punica's BGMV, one program per token.

``add_lora`` adds each token's adapter product to an adapted linear's output in place, in two launches:

- shrink: ``h[t] = lora_a[slot[t]] @ x[t]``, ``h`` [tokens, num_parts * rank] in float32; one program per
  (token, block of ``h``'s columns) dots its slot's rows of A with the token's input.
- expand: ``y[t, offsets[p] + j] += h[t, p * rank:(p + 1) * rank] @ lora_b[p][slot[t], :, j]``; one program per
  (token, block of output columns) does that block of every part (up to three parts per launch: q, k and v).

Each program reads its token's slot from ``token_slots`` on the device and returns at once for -1 (no adapter),
so the host never reads the slots and a CUDA graph can hold both launches. The adapters' weights may be narrower
than ``x`` (``--lora-dtype``). Everything is widened to float32 and summed there, ``h`` included, and each product
is rounded to ``y``'s dtype before it is added, as in ``tokenmill.lora.kernels.TorchLoRAKernels``, which computes in
``x``'s dtype: in float16 or bfloat16 the two differ by that dtype's rounding of ``h`` and of the product.

Every program of a token reads its slot's rows of A (or a block of B): over a decode batch the weights stay in L2,
and a long prompt reads them once per token (an SGMV that tiled the tokens of one adapter for ``tl.dot`` would read
them once per tile).

On a machine without a GPU the kernels run under the Triton interpreter, which is chosen when the kernels are
decorated: ``TRITON_INTERPRET=1`` must be in the environment before this module is imported (``is_interpreted``
tells).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

__all__ = ["SUPPORTED_DTYPES", "add_lora", "is_interpreted"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Parts one expand launch adds (a merged qkv has three); more take more launches.
_MAX_PARTS_PER_LAUNCH = 3


def is_interpreted() -> bool:
    """Whether the kernels were decorated for the Triton interpreter (``TRITON_INTERPRET=1`` at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_shrink_kernel, InterpretedFunction)


# ---------------------------------------------------------------- kernels


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, token_slots_ptr, h_ptr,
    x_stride, h_stride, in_features, num_rows,
    BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + token)  # int64
    if slot < 0:
        return
    rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < num_rows
    cols = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + slot * num_rows * in_features + rows[:, None] * in_features  # [BLOCK_ROWS, 1]
    x_row = x_ptr + token * x_stride
    acc = tl.zeros((BLOCK_ROWS, BLOCK_K), dtype=tl.float32)
    for start in range(0, in_features, BLOCK_K):
        k = start + cols
        k_mask = k < in_features
        x = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc += a.to(tl.float32) * x[None, :]
    tl.store(h_ptr + token * h_stride + rows, tl.sum(acc, axis=1), mask=row_mask)


@triton.jit
def _expand_part(
    h_row, b_ptr, y_row, slot, part, rank, out_size, offset, start,
    RANK_BLOCK: tl.constexpr, BLOCK_OUT: tl.constexpr,
):  # fmt: skip
    # Adds columns start to start + BLOCK_OUT of one part of a token's product to its row y_row (the part's
    # lora_b at b_ptr).
    if start < out_size:  # the block has columns of this part
        ranks = tl.arange(0, RANK_BLOCK)
        rank_mask = ranks < rank
        cols = start + tl.arange(0, BLOCK_OUT)
        col_mask = cols < out_size
        h = tl.load(h_row + part * rank + ranks, mask=rank_mask, other=0.0)  # [RANK_BLOCK] float32
        b_rows = b_ptr + slot * rank * out_size + ranks[:, None] * out_size  # [RANK_BLOCK, 1]
        b = tl.load(b_rows + cols[None, :], mask=rank_mask[:, None] & col_mask[None, :], other=0.0)
        delta = tl.sum(h[:, None] * b.to(tl.float32), axis=0)  # [BLOCK_OUT]
        y_ptrs = y_row + offset + cols
        y = tl.load(y_ptrs, mask=col_mask, other=0.0)
        total = y.to(tl.float32) + delta.to(y.dtype).to(tl.float32)  # torch's y += delta.to(y.dtype)
        tl.store(y_ptrs, total.to(y.dtype), mask=col_mask)


@triton.jit
def _expand_kernel(
    h_ptr, token_slots_ptr, y_ptr, b0_ptr, b1_ptr, b2_ptr,
    h_stride, y_stride, rank, size0, size1, size2, offset0, offset1, offset2,
    NUM_PARTS: tl.constexpr, RANK_BLOCK: tl.constexpr, BLOCK_OUT: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + token)  # int64
    if slot < 0:
        return
    start = tl.program_id(1) * BLOCK_OUT
    h_row = h_ptr + token * h_stride
    y_row = y_ptr + token * y_stride
    _expand_part(h_row, b0_ptr, y_row, slot, 0, rank, size0, offset0, start, RANK_BLOCK, BLOCK_OUT)
    if NUM_PARTS > 1:
        _expand_part(h_row, b1_ptr, y_row, slot, 1, rank, size1, offset1, start, RANK_BLOCK, BLOCK_OUT)
    if NUM_PARTS > 2:
        _expand_part(h_row, b2_ptr, y_row, slot, 2, rank, size2, offset2, start, RANK_BLOCK, BLOCK_OUT)


# ---------------------------------------------------------------- launcher


def add_lora(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    offsets: Sequence[int],
    token_slots: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """Add to ``y`` [tokens, out] (last dimension contiguous) in place each token's adapter product, for ``x``
    [tokens, in], ``lora_a`` [slots, parts * rank, in] and ``lora_b[p]`` [slots, rank, out_p] (contiguous, one
    dtype), part ``p`` landing in ``y``'s columns from ``offsets[p]``, and ``token_slots`` [tokens] int64 (-1: no
    adapter; the others must be below ``slots``: the device does not check them). ``x``, the adapters and ``y`` are
    each in one of ``SUPPORTED_DTYPES``."""
    num_tokens, in_features = x.shape
    num_slots, num_rows, _ = lora_a.shape
    num_parts = len(lora_b)
    rank = num_rows // num_parts
    assert lora_a.shape == (num_slots, num_parts * rank, in_features), (lora_a.shape, num_parts, x.shape)
    assert {x.dtype, lora_a.dtype, y.dtype} <= set(SUPPORTED_DTYPES), (x.dtype, lora_a.dtype, y.dtype)
    assert lora_a.is_contiguous() and all(b.is_contiguous() for b in lora_b), "lora_a and lora_b must be contiguous"
    for b in lora_b:
        assert b.shape[:2] == (num_slots, rank) and b.dtype == lora_a.dtype, (b.shape, b.dtype, lora_a.shape)
    assert len(offsets) == num_parts and all(
        0 <= offset and offset + b.shape[2] <= y.shape[1] for b, offset in zip(lora_b, offsets, strict=True)
    ), (offsets, [b.shape[2] for b in lora_b], y.shape)
    assert y.shape[0] == num_tokens and y.stride(-1) == 1, (y.shape, y.stride(), num_tokens)
    assert token_slots.shape == (num_tokens,) and token_slots.dtype == torch.int64, token_slots
    assert x.device == lora_a.device == y.device == token_slots.device, (x.device, lora_a.device, y.device)
    if num_tokens == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    token_slots = token_slots.contiguous()
    h = torch.empty((num_tokens, num_rows), dtype=torch.float32, device=x.device)  # [num_tokens, num_parts * rank]
    block_rows = min(32, triton.next_power_of_2(num_rows))
    _shrink_kernel[(num_tokens, triton.cdiv(num_rows, block_rows))](
        x, lora_a, token_slots, h, x.stride(0), h.stride(0), in_features, num_rows,
        BLOCK_ROWS=block_rows, BLOCK_K=min(128, triton.next_power_of_2(in_features)), num_warps=4,
    )  # fmt: skip
    for first in range(0, num_parts, _MAX_PARTS_PER_LAUNCH):
        parts = range(first, min(num_parts, first + _MAX_PARTS_PER_LAUNCH))
        pointers = [lora_b[p] for p in parts] + [lora_b[first]] * (_MAX_PARTS_PER_LAUNCH - len(parts))
        sizes = [lora_b[p].shape[2] for p in parts] + [0] * (_MAX_PARTS_PER_LAUNCH - len(parts))
        part_offsets = [offsets[p] for p in parts] + [0] * (_MAX_PARTS_PER_LAUNCH - len(parts))
        block_out = min(128, triton.next_power_of_2(max(sizes)))
        h_parts = h[:, first * rank :]  # the chunk's part p is h_parts' columns p * rank onwards
        _expand_kernel[(num_tokens, triton.cdiv(max(sizes), block_out))](
            h_parts, token_slots, y, *pointers, h.stride(0), y.stride(0), rank, *sizes, *part_offsets,
            NUM_PARTS=len(parts), RANK_BLOCK=triton.next_power_of_2(rank), BLOCK_OUT=block_out, num_warps=4,
        )  # fmt: skip
