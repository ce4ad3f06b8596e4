"""Helpers shared by the KV cache tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.kv_cache import KVCacheManager, PrefixMatch, SlotAllocation


def prefill(
    manager: KVCacheManager, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None
) -> tuple[PrefixMatch, SlotAllocation]:
    """Admit a request the way the scheduler does (lookup, allocate the whole prompt, cache), checking invariants."""
    prefix = manager.lookup_prefix(token_ids, cache_salt)
    allocation = manager.allocate_slots(request_id, prefix.num_tokens, len(token_ids) - prefix.num_tokens, prefix)
    assert allocation is not None, f"no room for {request_id}"
    manager.cache_full_blocks(request_id, token_ids, len(token_ids), cache_salt)
    manager.check_invariants()
    return prefix, allocation


def snapshot(manager: KVCacheManager) -> Any:
    """Everything the manager holds, private parts included, for "changed nothing" checks."""
    pool = manager._pool
    return (
        list(pool._ref_counts),
        list(pool._hashes),
        list(pool._free),
        list(pool._evictable),
        dict(pool._index),
        {
            request_id: (list(s.block_ids), list(s.block_hashes), s.cache_salt)
            for request_id, s in manager._requests.items()
        },
        manager.prefix_cache_queries,
        manager.prefix_cache_hits,
    )
