"""The ``cpu`` KV tier: the tier contract, and evicted blocks passed on to the tier below."""

from __future__ import annotations

import torch
from tokenmill_plugins.kv_tiers.cpu import CPUKVTier

from tokenmill.testing import check_kv_tier

SHAPE = (2, 2, 4, 2, 8)  # [num_layers, 2, block_size, num_kv_heads, head_dim]


def test_cpu_tier_passes_the_kv_tier_conformance_check() -> None:
    check_kv_tier(CPUKVTier)


def test_a_store_past_capacity_returns_the_least_recently_used_block() -> None:
    blocks = [torch.full(SHAPE, float(i), dtype=torch.float16) for i in range(3)]
    hashes = [bytes([i]) * 16 for i in range(3)]
    tier = CPUKVTier(capacity_bytes=2 * blocks[0].numel() * blocks[0].element_size())
    assert tier.store(hashes[0], blocks[0]) == [] and tier.store(hashes[1], blocks[1]) == []
    assert tier.fetch(hashes[0]) is not None  # block 1 is now the least recently used

    evicted = tier.store(hashes[2], blocks[2])

    assert [h for h, _ in evicted] == [hashes[1]] and torch.equal(evicted[0][1], blocks[1])
    assert not tier.contains(hashes[1]) and tier.contains(hashes[0]) and tier.contains(hashes[2])
    assert tier.num_bytes == tier.capacity_bytes
    tier.close()
