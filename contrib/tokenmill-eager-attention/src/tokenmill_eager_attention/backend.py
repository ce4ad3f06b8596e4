"""Eager attention over tokenmill's paged KV cache, one request at a time."""

from __future__ import annotations

import torch

from tokenmill import AttentionBackend, AttentionLayerSpec, AttentionMetadata


class EagerAttentionBackend(AttentionBackend):
    name = "eager"

    def prepare(self, metadata: AttentionMetadata, block_size: int) -> None:
        # Per request: its token range in the batch and the cache slots of its keys.
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        requests = []
        for i, seq_len in enumerate(seq_lens):
            positions = torch.arange(seq_len, device=metadata.block_tables.device)
            slots = metadata.block_tables[i, positions // block_size].long() * block_size + positions % block_size
            requests.append((starts[i], starts[i + 1], slots))
        metadata.backend_state = requests

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        key_cache = kv_cache[0].view(-1, layer.num_kv_heads, layer.head_dim)
        value_cache = kv_cache[1].view(-1, layer.num_kv_heads, layer.head_dim)
        key_cache[metadata.slot_mapping] = key.to(key_cache.dtype)
        value_cache[metadata.slot_mapping] = value.to(value_cache.dtype)
        group = layer.num_heads // layer.num_kv_heads
        out = torch.empty_like(query)
        for start, end, slots in metadata.backend_state:
            q = query[start:end].transpose(0, 1).float()  # [heads, q_len, dim]
            k = key_cache[slots].repeat_interleave(group, dim=1).transpose(0, 1).float()  # [heads, seq, dim]
            v = value_cache[slots].repeat_interleave(group, dim=1).transpose(0, 1).float()
            scores = q @ k.transpose(1, 2) * layer.scale  # [heads, q_len, seq]
            q_pos = metadata.positions[start:end, None]
            k_pos = torch.arange(slots.shape[0], device=q.device)[None, :]
            allowed = k_pos <= q_pos
            if layer.sliding_window is not None:
                allowed &= k_pos > q_pos - layer.sliding_window
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[start:end] = (scores.softmax(-1) @ v).transpose(0, 1).to(out.dtype)
        return out
