"""A Triton fused mixture-of-experts for GPUs, with its launcher: a layer's routed experts over a step's tokens in
two grouped matmuls, without reading the routing on the host.

``fused_experts(x, gate_up, down, topk_weights, topk_ids)`` is ``sum_k topk_weights[t, k] * expert(x[t])`` over each
token's experts, ``expert(x) = down[e] @ act(gate) * up`` with ``gate, up = gate_up[e] @ x`` split in halves:

1. ``align``: the step's (token, expert) pairs sorted by expert, each expert's run padded to a multiple of
   ``BLOCK_M`` rows, and each block of rows tagged with its expert (vLLM's ``moe_align_block_size``), in torch
   operations on the device: the grid is sized for the worst case (every expert's run padded), and blocks past
   the last run, or of pairs another shard holds (expert -1, expert parallelism), return at once. No host read, so
   a CUDA graph can hold the layer.
2. ``_grouped_matmul_kernel``: one program per (block of pairs, block of output columns) multiplies the block's
   rows, gathered from the input, by its expert's weights with ``tl.dot``, each expert's weights read once per
   block of its pairs; the second pass scales each pair's row by its router weight.
3. The activation (SiLU or GELU-tanh, times up) between them, and the sum over each token's ``top_k`` rows after,
   in torch.

Weights are dense and stacked (``Experts.stacked_weights``): ``gate_up`` ``[experts, 2 * inner, hidden]``, ``down``
``[experts, hidden, inner]``, in ``x``'s dtype; products are summed in float32.

On a machine without a GPU the kernel runs under the Triton interpreter, which is chosen when it is decorated:
``TRITON_INTERPRET=1`` must be in the environment before this module is imported (``is_interpreted`` tells).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["SUPPORTED_DTYPES", "align", "fused_experts", "is_interpreted"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK_M = 16
_BLOCK_N = 64
_BLOCK_K = 32


def is_interpreted() -> bool:
    """Whether the kernel was decorated for the Triton interpreter (``TRITON_INTERPRET=1`` at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_grouped_matmul_kernel, InterpretedFunction)


@triton.jit
def _grouped_matmul_kernel(
    a_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, pair_weights_ptr,
    a_stride, w_stride_e, w_stride_n, out_stride, n, k, a_row_divisor, num_experts,
    SCALE_BY_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert >= num_experts:  # past the last expert's run
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # -1: padding
    valid = pairs >= 0
    rows = tl.where(valid, pairs // a_row_divisor, 0)  # the input row of each pair: its token, or the pair itself
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    column_ok = columns < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        depth = start + tl.arange(0, BLOCK_K)
        depth_ok = depth < k
        a = tl.load(a_ptr + rows[:, None] * a_stride + depth[None, :], mask=valid[:, None] & depth_ok[None, :],
                    other=0.0)  # fmt: skip
        w = tl.load(w_ptr + expert * w_stride_e + columns[None, :] * w_stride_n + depth[:, None],
                    mask=column_ok[None, :] & depth_ok[:, None], other=0.0)  # fmt: skip
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
    if SCALE_BY_WEIGHT:
        acc *= tl.load(pair_weights_ptr + tl.where(valid, pairs, 0), mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + tl.where(valid, pairs, 0)[:, None] * out_stride + columns[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & column_ok[None, :])  # fmt: skip


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int = _BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of ``topk_ids`` ``[tokens, top_k]`` (flattened: pair ``p`` is token ``p // top_k``'s ``p % top_k``-th
    choice) sorted by expert, each expert's run padded with -1 to a multiple of ``block_m``: ``(sorted_pairs
    [blocks * block_m] int32, block_experts [blocks] int32)``, ``blocks`` the worst case for this many pairs; a
    block past the last run has expert ``num_experts``. Pairs of expert -1 are left out. All on the device."""
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    blocks = (num_pairs + block_m - 1) // block_m + num_experts
    ids = torch.where(ids < 0, num_experts, ids)  # another shard's pairs sort last, and are not placed
    order = ids.argsort(stable=True)
    sorted_ids = ids[order]
    counts = torch.bincount(ids, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    run_start = torch.cumsum(padded, 0) - padded  # each expert's first row in the padded order
    first_of_expert = torch.cumsum(counts, 0) - counts  # each expert's first pair in the sorted order
    held = sorted_ids < num_experts
    expert_of = sorted_ids.clamp(max=num_experts - 1)
    rank_in_run = torch.arange(num_pairs, device=device) - first_of_expert[expert_of]
    destination = run_start[expert_of] + rank_in_run
    sorted_pairs = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=device)
    sorted_pairs[destination[held]] = order[held].to(torch.int32)
    run_end = torch.cumsum(padded, 0)  # a block belongs to the first expert whose run ends after its first row
    block_first_row = torch.arange(blocks, device=device) * block_m
    block_experts = torch.searchsorted(run_end, block_first_row, right=True).to(torch.int32)
    return sorted_pairs, block_experts


def _grouped_matmul(
    a: torch.Tensor,
    weights: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_experts: torch.Tensor,
    out: torch.Tensor,
    a_row_divisor: int,
    pair_weights: torch.Tensor | None,
) -> None:
    """``out[p] = weights[expert of p] @ a[p // a_row_divisor]`` (times ``pair_weights[p]`` when given) for each
    pair ``p`` placed in ``sorted_pairs``; other rows of ``out`` are left as they are."""
    num_experts, n, k = weights.shape
    grid = (block_experts.numel(), triton.cdiv(n, _BLOCK_N))
    _grouped_matmul_kernel[grid](
        a, weights, out, sorted_pairs, block_experts, pair_weights if pair_weights is not None else out,
        a.stride(0), weights.stride(0), weights.stride(1), out.stride(0), n, k, a_row_divisor, num_experts,
        SCALE_BY_WEIGHT=pair_weights is not None, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """``[tokens, hidden]``: each token's experts' outputs weighted by the router, for ``x`` ``[tokens, hidden]``,
    ``gate_up`` ``[experts, 2 * inner, hidden]``, ``down`` ``[experts, hidden, inner]`` (contiguous, ``x``'s
    dtype), ``topk_weights`` ``[tokens, top_k]`` and ``topk_ids`` ``[tokens, top_k]`` int64 (-1: another shard's
    expert, adding nothing). ``activation``: ``silu`` or ``gelu_tanh``, on the gate, times up."""
    tokens, top_k = topk_ids.shape
    num_experts, two_inner, hidden = gate_up.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    sorted_pairs, block_experts = align(topk_ids, num_experts)
    num_pairs = tokens * top_k
    gate_up_out = torch.empty(num_pairs, two_inner, dtype=x.dtype, device=x.device)
    _grouped_matmul(x, gate_up, sorted_pairs, block_experts, gate_up_out, top_k, None)
    gate, up = gate_up_out.chunk(2, dim=-1)
    inner_out = (F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)) * up
    down_out = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)  # another shard's pairs stay zero
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_matmul(inner_out, down, sorted_pairs, block_experts, down_out, 1, weights)
    return down_out.view(tokens, top_k, hidden).sum(dim=1)
