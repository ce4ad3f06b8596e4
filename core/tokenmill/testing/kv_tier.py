"""``DictKVTier``: the smallest correct KV tier, in memory; the reference ``check_kv_tier`` is tested with."""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

import torch

from tokenmill.kv_cache.tier import KVTier


class DictKVTier(KVTier):
    """Blocks in an ordered dict, least recently used first; evicts from the front past capacity."""

    name: ClassVar[str] = "dict"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._num_bytes = 0

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def store(self, block_hash: bytes, block: torch.Tensor) -> None:
        size = block.numel() * block.element_size()
        if size > self.capacity_bytes:
            self.stats.rejected += 1
            return
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)  # equal hashes mean equal contents: nothing to write
            return
        self._blocks[block_hash] = block.detach().to("cpu", copy=True)
        self._num_bytes += size
        self.stats.bytes_written += size
        while self._num_bytes > self.capacity_bytes:
            _, evicted = self._blocks.popitem(last=False)
            self._num_bytes -= evicted.numel() * evicted.element_size()

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
