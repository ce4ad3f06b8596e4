"""``MemoryKVTier``: KV blocks in process memory, least recently used evicted first and passed on.

The base of the built-in ``cpu`` tier, of the receiving end of the ZeroMQ KV
connector, and of ``tokenmill.testing.DictKVTier``; a plugin's own memory tier
can extend it (override ``_copy`` to place blocks elsewhere).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

import torch

from tokenmill.kv_cache.tier import KVTier


class MemoryKVTier(KVTier):
    """Blocks in an ordered dict, least recently used first, within ``capacity_bytes``."""

    name: ClassVar[str] = "memory"

    def __init__(self, capacity_bytes: int, fingerprint: str = "") -> None:
        super().__init__(capacity_bytes, fingerprint)
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._num_bytes = 0

    @property
    def num_bytes(self) -> int:
        """Bytes held now."""
        return self._num_bytes

    def _copy(self, block: torch.Tensor) -> torch.Tensor:
        """The tier's own copy of a block being stored (the caller reuses its tensor)."""
        return block.detach().to("cpu", copy=True)

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def store(self, block_hash: bytes, block: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        size = block.numel() * block.element_size()
        if size > self.capacity_bytes:
            self.stats.rejected += 1
            return []
        if block_hash in self._blocks:  # equal hashes mean equal contents: nothing to write
            self._blocks.move_to_end(block_hash)
            return []
        self._blocks[block_hash] = self._copy(block)
        self._num_bytes += size
        self.stats.bytes_written += size
        evicted: list[tuple[bytes, torch.Tensor]] = []
        while self._num_bytes > self.capacity_bytes:
            old_hash, old = self._blocks.popitem(last=False)
            self._num_bytes -= old.numel() * old.element_size()
            evicted.append((old_hash, old))
        return evicted

    def fetch(self, block_hash: bytes) -> torch.Tensor | None:
        block = self._blocks.get(block_hash)
        if block is None:
            self.stats.misses += 1
            return None
        self._blocks.move_to_end(block_hash)
        self.stats.hits += 1
        self.stats.bytes_read += block.numel() * block.element_size()
        return block

    def close(self) -> None:
        self._blocks.clear()
        self._num_bytes = 0
