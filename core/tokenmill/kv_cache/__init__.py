"""The paged KV cache's bookkeeping: blocks, block tables, ref counts, prefix caching."""

from __future__ import annotations

from tokenmill.kv_cache.block_hash import block_hashes, hash_block, iter_block_hashes, root_hash
from tokenmill.kv_cache.block_pool import BlockPool
from tokenmill.kv_cache.manager import KVCacheManager, PagedKVCacheManager, PrefixMatch, SlotAllocation
from tokenmill.kv_cache.tier import KVTier

__all__ = [
    "BlockPool",
    "KVCacheManager",
    "KVTier",
    "PagedKVCacheManager",
    "PrefixMatch",
    "SlotAllocation",
    "block_hashes",
    "hash_block",
    "iter_block_hashes",
    "root_hash",
]
