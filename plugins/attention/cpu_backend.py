"""The ``cpu`` attention backend: paged attention with AVX2 kernels, no gather, no masks.

Each token attends over its own request's cache blocks in place (see
``tokenmill.kernels.paged_attention.cpu``), so a decode step costs what its keys and values
weigh, and a step mixing a long prompt chunk with many decode tokens does not pad every
request to the chunk's length, as the ``torch`` reference backend does.
Long prompt chunks go to torch's ``scaled_dot_product_attention`` instead (its blocked
kernel runs prefill faster than a per-token loop): one call per such chunk, over the
chunk's keys gathered once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from tokenmill.kernels.paged_attention import cpu as kernels


@dataclass
class _StepState:
    token_req: torch.Tensor  # [num_tokens] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, contiguous


class CpuAttentionBackend(AttentionBackend):
    name: ClassVar[str] = "cpu"
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu",)
    auto_priority: ClassVar[int] = 10

    @classmethod
    def is_available(cls) -> bool:
        return kernels.is_available()

    def __init__(self) -> None:
        kernels.load()  # build (first run on a machine) or load the C++ now, not inside the first step

    def prepare(self, metadata: AttentionMetadata, block_size: int) -> None:
        query_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
        token_req = torch.repeat_interleave(
            torch.arange(metadata.num_reqs, dtype=torch.int32), query_lens.long(), output_size=metadata.num_tokens
        )  # [num_tokens]
        metadata.backend_state = _StepState(token_req=token_req, block_tables=metadata.block_tables.contiguous())

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
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # each [num_blocks, block_size, kv_heads, head_dim]
        kernels.write_kv_cache(key.contiguous(), value.contiguous(), key_cache, value_cache, metadata.slot_mapping)
        return kernels.paged_attention(
            query.contiguous(),
            key_cache,
            value_cache,
            state.block_tables,
            state.token_req,
            metadata.positions,
            layer.scale,
            layer.sliding_window,
        )
