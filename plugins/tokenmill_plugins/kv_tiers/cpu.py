"""``cpu``: KV blocks in host memory, least recently used evicted first (and passed down to the next tier).

On a GPU machine the blocks are pinned, so loads and write-backs are DMA copies the
device can overlap with compute; on a CPU machine they are plain copies, which still
beat recomputing a prefix by far (docs/benchmarks-history.md#kv-tiers-and-disaggregated-prefill).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from tokenmill.kv_cache.memory_tier import MemoryKVTier


class CPUKVTier(MemoryKVTier):
    """Blocks in host memory within ``capacity_bytes``, pinned when a CUDA device is present."""

    name: ClassVar[str] = "cpu"

    def __init__(self, capacity_bytes: int, fingerprint: str = "") -> None:
        super().__init__(capacity_bytes, fingerprint)
        self._pin = torch.cuda.is_available()

    def _copy(self, block: torch.Tensor) -> torch.Tensor:
        copy = torch.empty(block.shape, dtype=block.dtype, pin_memory=self._pin)
        return copy.copy_(block)
