"""The ``cpu`` attention backend: paged attention with AVX2 kernels, no gather, no masks.

Each token attends over its own request's cache blocks in place (see
``tokenmill_kernels.paged_attention.cpu``), so a decode step costs what its keys and values
weigh, and a step mixing a long prompt chunk with many decode tokens does not pad every
request to the chunk's length, as the ``torch`` reference backend does. The cache may be
float16 (``cache.kv_cache_dtype``), which halves what a decode step reads, or ``fp8``/``int8``
(``tokenmill.attention.kv_quant``: one byte per value and a scale per token and KV head), which
halves it again; the kernel dequantizes rows as it reads them.

Prompt chunks longer than ``max_kernel_query_len`` tokens go to torch's
``scaled_dot_product_attention`` instead: its blocked kernel computes a long prompt's
quadratic attention several times faster than a per-token loop. That is one SDPA call per
such chunk (a step rarely holds more than one), over the chunk's keys gathered once.

Draft trees (``metadata.draft_tree``): the kernel skips the keys of a tree token's other
branches (each tree token's visible nodes as a 64-bit mask); a long chunk holding tree tokens
gets the same as an SDPA mask.

Soft-capped scores (Gemma 2's ``attn_logit_softcapping``): the kernel caps them before its softmax; a long
chunk of such a layer is attended by the torch backend's capped attention (SDPA has no cap).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from tokenmill_kernels.paged_attention import cpu as kernels

from tokenmill.attention.backend import (
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
    tree_visibility,
)
from tokenmill.attention.kv_quant import read_kv
from tokenmill.attention.torch_backend import soft_capped_attention


@dataclass
class _LongChunk:
    """A request's tokens attended with SDPA: a long prompt chunk, or a draft tree with its parent tokens."""

    start: int  # its tokens are [start, end) of the step
    end: int
    key_slots: torch.Tensor  # [seq_len] int64: cache slot of each of its request's positions
    key_positions: torch.Tensor  # [1, seq_len] int64
    query_positions: torch.Tensor  # [end - start, 1] int64: in the text (a tree node's: its root's plus its depth)
    tree_mask: torch.Tensor | None = None  # [end - start, seq_len] bool: causal, less other branches of a tree


@dataclass
class _StepState:
    token_req: torch.Tensor  # [num_tokens] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, contiguous
    long_chunks: list[_LongChunk] = field(default_factory=list)
    kernel_tokens: torch.Tensor | None = None  # [n] int64: tokens for the kernel, when some go to SDPA
    tree_start: torch.Tensor | None = None  # [num_tokens] int64: the token's tree's first position, or -1
    tree_bits: torch.Tensor | None = None  # [num_tokens] int64: the tree nodes it sees, bit j for node j


class CpuAttentionBackend(AttentionBackend):
    name: ClassVar[str] = "cpu"
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu",)
    auto_priority: ClassVar[int] = 10
    supports_draft_trees: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.float8_e4m3fn, torch.int8)
    #: Longer prompt chunks are attended with SDPA rather than the per-token kernel.
    max_kernel_query_len: ClassVar[int] = 64

    @classmethod
    def is_available(cls) -> bool:
        return kernels.is_available()

    def __init__(self) -> None:
        kernels.prepare()  # start building (first run on a machine) or loading the C++ now, beside the weights

    def prepare(self, metadata: AttentionMetadata, block_size: int) -> None:
        query_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
        token_req = torch.repeat_interleave(
            torch.arange(metadata.num_reqs, dtype=torch.int32), query_lens.long(), output_size=metadata.num_tokens
        )  # [num_tokens]
        state = _StepState(token_req=token_req, block_tables=metadata.block_tables.contiguous())
        tree = metadata.draft_tree
        positions = metadata.positions
        if tree is not None:
            state.tree_start = torch.full((metadata.num_tokens,), -1, dtype=torch.int64)
            state.tree_start[tree.token_index] = tree.tree_start
            state.tree_bits = torch.zeros(metadata.num_tokens, dtype=torch.int64)
            bit = torch.ones(tree.visible.shape[1], dtype=torch.int64) << torch.arange(tree.visible.shape[1])
            state.tree_bits[tree.token_index] = (tree.visible.long() * bit).sum(dim=1)
            is_tree_token = state.tree_start >= 0
            positions = tree.rotary_positions
        if metadata.max_query_len > self.max_kernel_query_len:
            is_kernel_token = torch.ones(metadata.num_tokens, dtype=torch.bool)
            starts, seq_lens = metadata.query_start_loc.tolist(), metadata.seq_lens.tolist()
            to_sdpa = query_lens > self.max_kernel_query_len  # [num_reqs]
            for req in to_sdpa.nonzero().flatten().tolist():
                start, end, seq_len = starts[req], starts[req + 1], seq_lens[req]
                key_positions = torch.arange(seq_len)  # [seq_len]
                blocks = metadata.block_tables[req].long()[key_positions // block_size]
                chunk = _LongChunk(
                    start=start,
                    end=end,
                    key_slots=blocks * block_size + key_positions % block_size,
                    key_positions=key_positions[None, :],
                    query_positions=positions[start:end, None],
                )
                if tree is not None and bool(is_tree_token[start:end].any()):
                    chunk.tree_mask = key_positions[None, :] <= metadata.positions[start:end, None]  # causal
                    in_chunk = (tree.token_index >= start) & (tree.token_index < end)
                    rows = tree.token_index[in_chunk] - start
                    chunk.tree_mask[rows] &= tree_visibility(
                        tree.tree_start[in_chunk], tree.visible[in_chunk], key_positions
                    )
                state.long_chunks.append(chunk)
                is_kernel_token[start:end] = False
            state.kernel_tokens = is_kernel_token.nonzero().flatten()
        metadata.backend_state = state

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
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # each [num_blocks, block_size, kv_heads, row]
        kernels.write_kv_cache(key.contiguous(), value.contiguous(), key_cache, value_cache, metadata.slot_mapping)
        if not state.long_chunks:
            return self._kernel(layer, query.contiguous(), key_cache, value_cache, state, metadata.positions)

        out = query.new_empty(query.shape)  # [num_tokens, heads, head_dim]
        assert state.kernel_tokens is not None
        if state.kernel_tokens.numel():
            tokens = state.kernel_tokens
            out[tokens] = self._kernel(
                layer, query[tokens].contiguous(), key_cache, value_cache, state, metadata.positions[tokens], tokens
            )
        row = kv_cache.shape[-1]  # head_dim, plus a quantized cache's scale
        flat_keys = key_cache.view(-1, layer.num_kv_heads, row)  # [num_slots, kv_heads, row]
        flat_values = value_cache.view(-1, layer.num_kv_heads, row)
        for chunk in state.long_chunks:
            # A whole prompt without a window is plain causal attention, which SDPA computes without
            # a mask and skipping the upper triangle (twice as fast); otherwise the mask says it.
            is_whole_prompt = (
                chunk.key_slots.shape[0] == chunk.end - chunk.start
                and layer.sliding_window is None
                and chunk.tree_mask is None
                and layer.logits_soft_cap is None
            )
            mask = None
            if not is_whole_prompt:
                mask = chunk.key_positions <= chunk.query_positions  # [query_len, seq_len]: causal
                if chunk.tree_mask is not None:
                    mask = chunk.tree_mask
                if layer.sliding_window is not None:  # (not in place: a tree mask serves every layer)
                    mask = mask & (chunk.key_positions > chunk.query_positions - layer.sliding_window)
            chunk_query = query[chunk.start : chunk.end].transpose(0, 1)[None]  # [1, heads, query_len, head_dim]
            keys = read_kv(flat_keys[chunk.key_slots], query.dtype).transpose(0, 1)[None]  # [1, kv_heads, seq_len, dim]
            values = read_kv(flat_values[chunk.key_slots], query.dtype).transpose(0, 1)[None]
            if layer.logits_soft_cap is not None:  # SDPA has no cap: the scores are computed whole
                assert mask is not None
                attended = soft_capped_attention(chunk_query, keys, values, mask, layer)
            else:
                attended = F.scaled_dot_product_attention(
                    chunk_query, keys, values, attn_mask=mask, is_causal=is_whole_prompt, scale=layer.scale,
                    enable_gqa=layer.num_heads != layer.num_kv_heads,
                )  # [1, heads, query_len, head_dim]  # fmt: skip
            out[chunk.start : chunk.end] = attended[0].transpose(0, 1)
        return out

    @staticmethod
    def _kernel(
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        state: _StepState,
        positions: torch.Tensor,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        token_req = state.token_req if tokens is None else state.token_req[tokens]
        tree_start, tree_bits = state.tree_start, state.tree_bits
        if tokens is not None and tree_start is not None and tree_bits is not None:
            tree_start, tree_bits = tree_start[tokens], tree_bits[tokens]
        return kernels.paged_attention(
            query, key_cache, value_cache, state.block_tables, token_req, positions, layer.scale, layer.sliding_window,
            tree_start, tree_bits, layer.logits_soft_cap,
        )  # fmt: skip
