"""``KVTierStack``: the KV tiers below the device cache, nearest first, with each tier's write policy.

The paged KV cache manager owns one and asks it three things: where a block
that missed on the device can be found (``contains``, no I/O), for its data
once the request is admitted (``fetch``), and to take blocks leaving the device
(``store_evicted``) or leaving with a finished request (``store_completed``).
Evictions cascade: what one ``eviction`` tier evicts goes to the next one below.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenmill.kv_cache.tier import KVTier, WritePolicy

if TYPE_CHECKING:
    import torch


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

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
