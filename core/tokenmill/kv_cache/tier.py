"""The KV tier interface: KV blocks kept outside device memory (host RAM, disk), addressed by block hash.

A tier is a content-addressed store. Its key is a block's chained hash
(``tokenmill.kv_cache.block_hash``): one hash names a whole prefix up to the
end of that block, salted by the model, KV dtype and tenant, so equal keys
mean equal K/V. Tiers stack below the device cache, nearest first. The KV
cache manager's owner calls them: ``store`` when a cached block is evicted
from the device (write-back), ``fetch`` when a prefix lookup misses on the
device, before recomputing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch


@dataclass
class KVTierStats:
    """Counters a tier keeps for /metrics."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    rejected: int = 0  # blocks found but unusable (corrupt, truncated, foreign)


class KVTier(ABC):
    """Stores and returns KV blocks by block hash, within a byte capacity.

    Built once per engine process as ``cls(capacity_bytes=...)`` (plus ``options=`` when its plugin
    declares options). All methods run in the engine process, from the engine loop, so none may block
    on slow I/O for long: a slow tier writes asynchronously. A block is one tensor
    ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (keys then values) in the KV cache's dtype,
    on the CPU.

    Contract (checked by ``tokenmill.testing.check_kv_tier``):
    - ``fetch`` after ``store`` of the same hash returns an equal tensor, until evicted;
    - ``fetch`` of an unknown hash returns None and never raises;
    - ``contains`` agrees with ``fetch``; a stored total above ``capacity_bytes`` evicts the least recently
      used blocks first.
    """

    #: Registered name.
    name: ClassVar[str]

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.stats = KVTierStats()

    @abstractmethod
    def contains(self, block_hash: bytes) -> bool:
        """Whether ``fetch(block_hash)`` would return a block now. Called once per block of a prefix miss."""

    @abstractmethod
    def store(self, block_hash: bytes, block: torch.Tensor) -> None:
        """Keep a copy of ``block`` under ``block_hash`` (write-back on device eviction); the caller may
        reuse ``block`` once this returns."""

    @abstractmethod
    def fetch(self, block_hash: bytes) -> torch.Tensor | None:
        """The block stored under ``block_hash``, or None (not stored, evicted, or failed its check)."""

    def close(self) -> None:
        """Flush pending writes and release resources; called once at engine shutdown."""
