"""The KV tier interface: KV blocks kept outside device memory (host RAM, disk, another engine), by block hash.

A tier is a content-addressed store. Its key is a block's chained hash
(``tokenmill.kv_cache.block_hash``): one hash names a whole prefix up to the
end of that block, salted by the engine's KV fingerprint (model, weight files,
dtypes, quantization, block size) and the request's tenant salt, so equal keys
mean equal K/V. Tiers stack below the device cache, nearest first; the paged
KV cache manager drives them (docs/kv_cache.md#kv-tiers):

- a block reaches a tier by its ``write`` policy: ``eviction`` tiers get the
  blocks the level above evicts (the device for the first of them, then each
  memory tier passes on what it evicts in turn); ``completion`` tiers get every
  full block of a request when the request leaves the engine, so they hold what
  was computed even if nothing is ever evicted (a disk tier that survives
  restarts, a KV connector shipping a prompt's blocks to a decode engine);
  ``none`` tiers are never written by this engine (the receiving end of a KV
  connector, filled by another engine);
- a prefix that misses on the device is looked up down the tiers with
  ``contains`` (no I/O); when the request is about to be admitted, a slow tier
  reads the blocks in the background (``prefetch``) while the running requests
  keep computing, and they are fetched once in memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    import torch

#: When blocks are written to a tier (see the module docstring).
WritePolicy = Literal["eviction", "completion", "none"]


@dataclass
class KVTierStats:
    """Counters a tier keeps, exported per tier in /metrics (``tokenmill:kv_tier_*``)."""

    hits: int = 0  # fetches that returned a block
    misses: int = 0  # fetches that returned None
    bytes_read: int = 0
    bytes_written: int = 0
    rejected: int = 0  # blocks found but unusable (corrupt, truncated, foreign) or refused (larger than capacity)
    errors: int = 0  # I/O failures (disk full, directory gone, read-only): the block is recomputed instead
    #: Prefix loads whose slowest block came from this tier, and their time from the start of their reads to
    #: the blocks being on the device. Kept by the KV cache manager's tier stack, not by the tier.
    loads: int = 0
    load_seconds: float = 0.0


class KVTier(ABC):
    """Stores and returns KV blocks by block hash, within a byte capacity.

    Built once per engine process, after the model loads, as
    ``cls(capacity_bytes=..., fingerprint=...)``, plus ``path=`` when the tier's config gives one and
    ``options=`` when its plugin declares options. ``fingerprint`` names what the K/V depends on besides the
    tokens (the engine's block-hash salt); a tier that outlives the process (a disk) must keep blocks of
    other fingerprints apart and refuse them. All methods run in the engine process, from the engine
    loop, so none may block on slow I/O for long: a slow tier writes asynchronously. A block is one tensor
    ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (keys then values) in the KV cache's dtype,
    on the CPU.

    ``capacity_bytes`` counts K/V bytes (``numel * element_size`` of the blocks held), not the bytes a tier's
    own format adds. The tensor ``fetch`` returns may be the tier's own (or a read-only buffer): callers copy
    from it and never write to it.

    Contract (checked by ``tokenmill.testing.check_kv_tier``):
    - ``fetch`` after ``store`` of the same hash returns an equal tensor, until evicted;
    - ``fetch`` of an unknown hash returns None and never raises; once ``fetch`` has returned None for a
      hash, ``contains`` says False for it until it is stored again;
    - ``contains`` agrees with ``fetch``; a stored total above ``capacity_bytes`` evicts the least recently
      used blocks first;
    - no method raises on I/O failure: it counts the failure in ``stats.errors`` and behaves as a miss.
    """

    #: Registered name.
    name: ClassVar[str]
    #: The write policy unless the tier's config sets ``write``.
    default_write: ClassVar[WritePolicy] = "eviction"
    #: Whether the tier's config must give a ``path`` (a directory, an address); tiers without one refuse it.
    takes_path: ClassVar[bool] = False

    def __init__(self, capacity_bytes: int, fingerprint: str = "") -> None:
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.stats = KVTierStats()

    @abstractmethod
    def contains(self, block_hash: bytes) -> bool:
        """Whether ``fetch(block_hash)`` would return a block now, without I/O. Called once per block of a
        prefix miss, and per block of a finished request for a ``completion`` tier."""

    @abstractmethod
    def store(self, block_hash: bytes, block: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        """Keep a copy of ``block`` under ``block_hash``; the caller may reuse ``block`` once this returns.

        Returns the blocks this store evicted whose data the tier still has at hand (a memory tier), so
        the next ``eviction`` tier below can take them; a tier that does not pass blocks on returns []."""

    @abstractmethod
    def fetch(self, block_hash: bytes) -> torch.Tensor | None:
        """The block stored under ``block_hash``, or None (not stored, evicted, or failed its check)."""

    def prefetch(self, block_hashes: Sequence[bytes]) -> bool:
        """Whether every one of these blocks (all held by this tier) can be fetched now without waiting on I/O;
        if not, start reading them in the background and say False. Called when a request whose prefix they
        are is about to be admitted: on False the request waits, and the running requests keep computing,
        until a later call says True. A memory tier is always ready (the default)."""
        return True

    def close(self) -> None:
        """Flush pending writes and release resources; called once at engine shutdown."""


def check_tier_path(cls: type[KVTier], name: str, capacity: str, path: str | None) -> None:
    """Raise ValueError, one line naming the fix, when a tier's config gives no path it needs or one it takes
    none of. Checked before any model loads (``PluginSystem.check_config``) and by the engine."""
    if cls.takes_path and not path:
        raise ValueError(f"kv_tiers: the {name!r} tier needs a path (e.g. --kv-tier {name}:{capacity}:/var/cache/kv)")
    if path and not cls.takes_path:
        raise ValueError(f"kv_tiers: the {name!r} tier takes no path (got {path!r})")
