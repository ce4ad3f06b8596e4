"""``KVTierStack``: the KV tiers below the device cache, nearest first, with each tier's write policy.

The paged KV cache manager owns one and asks it three things: where a block
that missed on the device can be found (``contains``, no I/O), for its data
once the request is admitted (``fetch``), and to take blocks leaving the device
(``store_evicted``) or leaving with a finished request (``store_completed``).
Evictions cascade: what one ``eviction`` tier evicts goes to the next one below.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.config import ConfigError
from tokenmill.kv_cache.tier import KVTier, WritePolicy, check_tier_path
from tokenmill.messages import KVTierStatsMessage
from tokenmill.plugin_manager import Slot
from tokenmill.weights.cache import model_file_stats

if TYPE_CHECKING:
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.memory import CacheLayout
    from tokenmill.model_loader import LoadedModel
    from tokenmill.plugin_manager import PluginSystem


def kv_fingerprint(config: EngineConfig, loaded: LoadedModel, layout: CacheLayout) -> str:
    """A digest of what the K/V of given tokens depends on besides them: the model's files (path, size and
    modification time of each), dtypes, quantization and the cache's block geometry. It salts every prefix-cache
    block hash, so a KV tier that outlives the process (a disk) never serves blocks of other weights."""
    arch = loaded.arch
    parts = {
        "model": str(loaded.path),
        "files": sorted(model_file_stats(Path(loaded.path)).items()),
        "dtype": str(loaded.dtype),
        "kv_cache_dtype": str(loaded.kv_cache_dtype),
        "quantization": config.model.quantization,
        "block": [layout.block_size, arch.num_layers, arch.num_kv_heads, arch.head_dim],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def load_tier_classes(config: EngineConfig, plugins: PluginSystem) -> list[type[KVTier]]:
    """The class of each configured tier, its path checked: a bad entry fails before the model loads."""
    classes = []
    for tier in config.kv_tiers:
        cls: type[KVTier] = plugins.load(Slot.KV_TIER, tier.name)
        try:
            check_tier_path(cls, tier.name, tier.capacity, tier.path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        classes.append(cls)
    return classes


def build_tier_stack(
    config: EngineConfig, plugins: PluginSystem, classes: Sequence[type[KVTier]], fingerprint: str
) -> KVTierStack:
    """The configured tiers, built from ``load_tier_classes``' classes; ``fingerprint`` names the K/V they hold
    (``kv_fingerprint``), so a tier that outlives the process never serves another model's blocks."""
    tiers = []
    for tier, cls in zip(config.kv_tiers, classes, strict=True):
        instance = plugins.instantiate(
            Slot.KV_TIER, tier.name, cls, capacity_bytes=tier.capacity_bytes, fingerprint=fingerprint,
            **({"path": tier.path} if tier.path else {}),
        )  # fmt: skip
        tiers.append((instance, tier.write or cls.default_write))
    return KVTierStack(tiers)


class KVTierStack:
    """Tiers nearest first, each with its write policy; counts loads and their time in the tiers' stats."""

    def __init__(self, tiers: Sequence[tuple[KVTier, WritePolicy]]) -> None:
        self.tiers = [tier for tier, _ in tiers]
        self._eviction = [tier for tier, write in tiers if write == "eviction"]
        self._completion = [tier for tier, write in tiers if write == "completion"]
        self._reads_started: dict[bytes, float] = {}  # first hash of a prefix being read -> when its reads began
        self._fetched: list[tuple[KVTier, float]] = []  # loads fetched, not yet on the device: (deepest tier, start)

    def __bool__(self) -> bool:
        return bool(self.tiers)

    @property
    def takes_evictions(self) -> bool:
        """Whether blocks the device evicts are wanted (some tier's policy is ``eviction``)."""
        return bool(self._eviction)

    def contains(self, block_hash: bytes) -> bool:
        return any(tier.contains(block_hash) for tier in self.tiers)

    def prefetch(self, block_hashes: Sequence[bytes]) -> bool:
        """Whether every block can be fetched now without waiting on I/O; if not, the tiers holding them start
        reading them in the background. A block no tier holds any more counts as ready (``fetch_all`` then
        says None)."""
        by_tier: dict[int, list[bytes]] = {}
        for block_hash in block_hashes:
            holder = next((i for i, tier in enumerate(self.tiers) if tier.contains(block_hash)), None)
            if holder is not None:
                by_tier.setdefault(holder, []).append(block_hash)
        ready = all([self.tiers[i].prefetch(hashes) for i, hashes in by_tier.items()])  # every tier starts
        if not ready and block_hashes:
            self._reads_started.setdefault(block_hashes[0], time.perf_counter())
            if len(self._reads_started) > 1024:  # prefixes whose request left while reading: forget the oldest
                del self._reads_started[next(iter(self._reads_started))]
        return ready

    def fetch_all(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor] | None:
        """The data of every block, each from the nearest tier that has it; None if one cannot be had now
        (evicted or failed its check since ``contains`` said yes: the tier no longer claims it)."""
        started = self._reads_started.pop(block_hashes[0], None) if block_hashes else None
        started = started if started is not None else time.perf_counter()
        blocks: list[torch.Tensor] = []
        deepest = 0
        for block_hash in block_hashes:
            found = next(
                ((i, d) for i, tier in enumerate(self.tiers)
                 if tier.contains(block_hash) and (d := tier.fetch(block_hash)) is not None),
                None,
            )  # fmt: skip
            if found is None:
                return None
            deepest = max(deepest, found[0])
            blocks.append(found[1])
        self._fetched.append((self.tiers[deepest], started))
        return blocks

    def loads_written(self) -> None:
        """The blocks fetched so far are on the device (the engine wrote them): count each load, with its time,
        under the deepest tier it read from (the one that set its latency)."""
        now = time.perf_counter()
        for tier, started in self._fetched:
            tier.stats.loads += 1
            tier.stats.load_seconds += now - started
        self._fetched = []

    def needs_completed(self, block_hash: bytes) -> bool:
        """Whether a ``completion`` tier lacks this block (so its data is worth reading off the device)."""
        return any(not tier.contains(block_hash) for tier in self._completion)

    def store_completed(self, block_hash: bytes, block: torch.Tensor) -> None:
        for tier in self._completion:
            if not tier.contains(block_hash):
                self._cascade(tier, [(block_hash, block)])

    def store_evicted(self, block_hash: bytes, block: torch.Tensor) -> None:
        if self._eviction:
            self._cascade(self._eviction[0], [(block_hash, block)])

    def _cascade(self, tier: KVTier, blocks: list[tuple[bytes, torch.Tensor]]) -> None:
        """Store ``blocks`` in ``tier``; what it evicts goes to the next ``eviction`` tier below it, and on."""
        below = self._eviction[self._eviction.index(tier) + 1 :] if tier in self._eviction else []
        for block_hash, block in blocks:
            evicted = tier.store(block_hash, block)
            if evicted and below:
                self._cascade(below[0], evicted)

    def stats(self) -> list[KVTierStatsMessage]:
        """Each tier's counters, nearest first, for the engine's stats."""
        return [
            KVTierStatsMessage(tier.name, t.hits, t.misses, t.bytes_read, t.bytes_written, t.rejected, t.errors,
                               t.loads, t.load_seconds)
            for tier in self.tiers for t in [tier.stats]
        ]  # fmt: skip

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
