"""The reference attention backend: plain torch, batched over requests.

Keys and values of every request are gathered from the paged cache into a
padded ``[num_reqs, max_seq_len]`` view and attended with one
``scaled_dot_product_attention`` call under a mask built from token positions.
No Python loop over requests runs per layer, so decode of many requests is a
few large tensor operations. Runs wherever torch does; faster kernels are plugins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionLayerSpec, AttentionMetadata, tree_visibility
from tokenmill.attention.kv_quant import read_kv, write_kv


@dataclass
class _StepState:
    token_req: torch.Tensor  # [num_tokens] int64: request of each token
    token_row: torch.Tensor  # [num_tokens] int64: index of each token within its request's query
    key_slots: torch.Tensor  # [num_reqs, max_seq_len] int64: cache slot of each key position
    query_positions: torch.Tensor  # [num_reqs, max_query_len, 1] int64
    key_positions: torch.Tensor  # [1, 1, max_seq_len] int64
    base_mask: torch.Tensor  # [num_reqs, 1, max_query_len, max_seq_len] bool: causal and in-sequence


class TorchAttentionBackend(AttentionBackend):
    name: ClassVar[str] = "torch"
    supports_draft_trees: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8,
    )  # fmt: skip

    def prepare(self, metadata: AttentionMetadata, block_size: int) -> None:
        device = metadata.positions.device
        num_reqs, max_q, max_s = metadata.num_reqs, metadata.max_query_len, metadata.max_seq_len
        query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).long()
        token_req = torch.repeat_interleave(torch.arange(num_reqs, device=device), query_lens)
        token_row = torch.arange(metadata.num_tokens, device=device) - metadata.query_start_loc[token_req].long()

        key_positions = torch.arange(max_s, device=device)  # [max_seq_len]
        blocks = metadata.block_tables.long()[:, key_positions // block_size]  # [num_reqs, max_seq_len]
        key_slots = blocks * block_size + key_positions % block_size
        in_sequence = key_positions[None, :] < metadata.seq_lens.long()[:, None]  # [num_reqs, max_seq_len]
        # Padding slots may hold garbage block ids; point them at slot 0, the mask hides them.
        key_slots = torch.where(in_sequence, key_slots, 0)

        query_positions = torch.zeros(num_reqs, max_q, dtype=torch.long, device=device)  # the causal order
        query_positions[token_req, token_row] = metadata.positions
        is_real_query = torch.zeros(num_reqs, max_q, dtype=torch.bool, device=device)
        is_real_query[token_req, token_row] = True
        causal = key_positions[None, None, :] <= query_positions[:, :, None]  # [num_reqs, max_q, max_s]
        mask = causal & in_sequence[:, None, :] & is_real_query[:, :, None]
        tree = metadata.draft_tree
        if tree is not None:  # a tree token sees, of its tree's nodes, only itself and its ancestors
            rows = (token_req[tree.token_index], token_row[tree.token_index])
            mask[rows] &= tree_visibility(tree.tree_start, tree.visible, key_positions)
            query_positions[rows] = tree.rotary_positions[tree.token_index]  # for the sliding window
        mask[:, :, 0] |= ~is_real_query  # an all-false row would make SDPA return NaN
        metadata.backend_state = _StepState(
            token_req=token_req,
            token_row=token_row,
            key_slots=key_slots,
            query_positions=query_positions[:, :, None],
            key_positions=key_positions[None, None, :],
            base_mask=mask[:, None],
        )

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        state: _StepState = metadata.backend_state
        row = kv_cache.shape[-1]  # head_dim, plus a quantized cache's scale (tokenmill.attention.kv_quant)
        key_cache = kv_cache[0].view(-1, layer.num_kv_heads, row)  # [num_slots, kv_heads, row]
        value_cache = kv_cache[1].view(-1, layer.num_kv_heads, row)
        write_kv(key_cache, metadata.slot_mapping, key)
        write_kv(value_cache, metadata.slot_mapping, value)

        keys = read_kv(key_cache[state.key_slots], query.dtype).transpose(1, 2)  # [num_reqs, kv_heads, max_s, dim]
        values = read_kv(value_cache[state.key_slots], query.dtype).transpose(1, 2)
        padded_query = query.new_zeros(
            metadata.num_reqs, metadata.max_query_len, layer.num_heads, layer.head_dim
        )  # [num_reqs, max_query_len, heads, dim]
        padded_query[state.token_req, state.token_row] = query
        mask = state.base_mask
        if layer.sliding_window is not None:
            window = state.key_positions > state.query_positions - layer.sliding_window
            mask = mask & window[:, None]
        if layer.logits_soft_cap is not None:
            out = soft_capped_attention(padded_query.transpose(1, 2), keys, values, mask, layer)
        else:
            out = F.scaled_dot_product_attention(
                padded_query.transpose(1, 2),
                keys,
                values,
                attn_mask=mask,
                scale=layer.scale,
                enable_gqa=layer.num_heads != layer.num_kv_heads,
            )  # [num_reqs, heads, max_query_len, dim]
        return out.transpose(1, 2)[state.token_req, state.token_row]


def soft_capped_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, layer: AttentionLayerSpec
) -> torch.Tensor:
    """Attention whose scaled scores pass through ``cap * tanh(score / cap)`` (SDPA has no such step), the softmax
    in float32; ``query`` [num_reqs, heads, max_q, dim], ``keys``/``values`` [num_reqs, kv_heads, max_s, dim]."""
    assert layer.logits_soft_cap is not None
    group = layer.num_heads // layer.num_kv_heads
    keys = keys.repeat_interleave(group, dim=1) if group > 1 else keys  # [num_reqs, heads, max_s, dim]
    values = values.repeat_interleave(group, dim=1) if group > 1 else values
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * layer.scale  # [num_reqs, heads, max_q, max_s]
    scores = torch.tanh(scores / layer.logits_soft_cap) * layer.logits_soft_cap
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(values.dtype)
    return torch.matmul(probs, values)  # [num_reqs, heads, max_q, dim]
