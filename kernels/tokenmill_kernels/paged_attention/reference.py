"""Plain-torch references for the paged-attention kernels: one request at a time, in float32.

Written for clarity, not speed. The kernel tests compare every Triton and CUDA
kernel of this package with these functions; the semantics are those of
``tokenmill.attention.torch_backend``: a query at position ``p`` attends to its
own request's tokens at positions ``<= p`` (and ``> p - sliding_window`` when a
window is set), read through the request's block table.

Tensor layouts (shared with the kernels):

- ``key_cache``/``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``
  (``kv_cache[0]`` and ``kv_cache[1]`` of one layer's cache); token ``t`` of a
  request lives in slot ``block_tables[req, t // block_size] * block_size + t % block_size``.
- ``query_start_loc``: ``[num_reqs + 1]``; request ``i``'s query tokens are rows
  ``[start[i], start[i + 1])`` of ``query``. A request with no tokens (padding) is skipped.
"""

from __future__ import annotations

import torch

__all__ = ["paged_attention_reference", "write_kv_cache_reference"]


def write_kv_cache_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; a negative slot marks a padding token
) -> None:
    """Store each token's key and value in its slot, skipping padding tokens (slot < 0).

    Called by the kernel tests to build the expected cache after ``write_kv_cache``.
    """
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[token].to(key_cache.dtype)
        value_cache[slot // block_size, slot % block_size] = value[token].to(value_cache.dtype)


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32: tokens of each request in the cache
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    positions: torch.Tensor,  # [num_tokens] int64
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of every query token over its request's cached tokens; returns ``[num_tokens, num_heads, head_dim]``.
    With ``logits_soft_cap``, the scaled scores pass through ``cap * tanh(score / cap)`` before the softmax.

    Called by the kernel tests (any mix of decode tokens and prefill chunks).
    Computes in float32 and rounds once to ``query.dtype`` at the end. Rows of
    tokens that belong to no request stay zero.
    """
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = key_cache.shape[1]
    out = torch.zeros_like(query)  # [num_tokens, num_heads, head_dim]
    starts = query_start_loc.tolist()
    for req, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[req], starts[req + 1]
        if start == end:
            continue
        key_positions = torch.arange(seq_len, device=query.device)  # [seq_len]
        blocks = block_tables[req, key_positions // block_size].long()
        offsets = key_positions % block_size
        keys = key_cache[blocks, offsets].float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        values = value_cache[blocks, offsets].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), keys) * scale  # [heads, q_len, seq_len]
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        query_positions = positions[start:end].to(key_positions.device)
        allowed = key_positions[None, :] <= query_positions[:, None]  # [q_len, seq_len]
        if sliding_window is not None:
            allowed &= key_positions[None, :] > query_positions[:, None] - sliding_window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
    return out
