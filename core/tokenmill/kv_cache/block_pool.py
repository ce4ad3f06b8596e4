"""The pool of KV blocks: ref counts, the free list, and the hash index of cached blocks.

Every block is in exactly one of three states:

- referenced: its ref count (the number of block tables holding it) is > 0;
- free: ref count 0 and no hash; its contents are garbage. The most recently freed is taken first, and
  blocks never used yet, lowest id first, only when no used one is free: the cache's memory is touched
  (on a CPU, made resident) only as far as the load has needed it (``num_touched_blocks``);
- evictable: ref count 0 but it still holds a hash, so a later request with the
  same prefix can take it back. Evictable blocks are kept in LRU order (the
  order they dropped to ref count 0) and are reused, oldest first, only when
  no free block is left; reusing one drops its hash.

"Available" blocks (``num_free_blocks``) are free + evictable. The pool knows
nothing about requests; the ``KVCacheManager`` owns the block tables.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

logger = logging.getLogger(__name__)


class BlockPool:
    """Ref-counted KV blocks with an LRU list of evictable cached blocks.

    Owned by one ``KVCacheManager`` in the engine process and called from it
    only; every method is O(blocks passed in) except ``reset_prefix_cache`` and
    ``check_invariants``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}; raise the KV cache memory budget")
        self._num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        # OrderedDicts as O(1) linked lists: popitem() takes the newest, popitem(last=False) the oldest, pop(id)
        # unlinks any. Free blocks are taken newest first; the unused ones start at the old end, lowest id newest.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks - 1, -1, -1))
        self._num_touched = 0  # blocks 0 .. _num_touched - 1 have been allocated at least once
        self._evictable: OrderedDict[int, None] = OrderedDict()
        #: When set, every cached block that ``allocate`` evicts is appended to ``evicted`` as
        #: ``(block_id, block_hash)``, for its owner to write back to a KV tier before it is overwritten.
        self.record_evictions = False
        self.evicted: list[tuple[int, bytes]] = []
        self._index: dict[bytes, int] = {}  # block hash -> the one block holding it
        # The index's net change since the last take_index_delta: hash -> True (gained) / False (lost).
        self._index_delta: dict[bytes, bool] = {}

    # ------------------------------------------------------------------ state

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_touched_blocks(self) -> int:
        """Blocks allocated at least once since start: always the lowest ids, ``0 .. num_touched_blocks - 1``."""
        return self._num_touched

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hash, referenced or evictable."""
        return len(self._index)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hashes[block_id]

    def is_available(self, block_id: int) -> bool:
        """Whether the block sits on the free or the evictable list (read from the lists, not the ref count)."""
        return block_id in self._free or block_id in self._evictable

    def get_cached_block(self, block_hash: bytes) -> int | None:
        """The block holding ``block_hash``, or None. Called once per block of a prefix lookup."""
        return self._index.get(block_hash)

    # ------------------------------------------------------------- operations

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks with ref count 1: free ones first (the most recently freed, then ones never used,
        lowest id first), then the least recently used evictable ones.

        The caller checks ``num_free_blocks`` first; asking for more is a bug.
        """
        assert 0 <= num_blocks <= self.num_free_blocks, (num_blocks, self.num_free_blocks)
        block_ids: list[int] = []
        for _ in range(num_blocks):
            if self._free:
                block_id, _ = self._free.popitem()
                self._num_touched = max(self._num_touched, block_id + 1)
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block_hash = self._hashes[block_id]
                assert block_hash is not None
                del self._index[block_hash]
                self._note_removed(block_hash)
                self._hashes[block_id] = None
                if self.record_evictions:
                    self.evicted.append((block_id, block_hash))
            assert self._ref_counts[block_id] == 0
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block; evictable ones come off the LRU list (a prefix hit, a fork)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                # Only cached blocks can be reached with ref count 0 (through the hash index).
                assert self._hashes[block_id] is not None, block_id
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given.

        Blocks reaching 0 go to the free list, or to the back of the LRU list if
        they hold a hash: the first one freed is the first one evicted.
        """
        for block_id in block_ids:
            ref_count = self._ref_counts[block_id] - 1
            assert ref_count >= 0, f"block {block_id} freed more often than referenced"
            self._ref_counts[block_id] = ref_count
            if ref_count == 0:
                if self._hashes[block_id] is None:
                    self._free[block_id] = None
                else:
                    self._evictable[block_id] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Register a referenced, completely filled block under ``block_hash``.

        Returns False, changing nothing, if the block already holds a hash or
        another block holds this one (the existing entry wins).
        """
        assert self._ref_counts[block_id] > 0, f"caching unreferenced block {block_id}"
        if self._hashes[block_id] is not None or block_hash in self._index:
            return False
        self._hashes[block_id] = block_hash
        self._index[block_hash] = block_id
        if self._index_delta.pop(block_hash, None) is None:  # (lost then regained: no net change)
            self._index_delta[block_hash] = True
        return True

    def uncache_block(self, block_id: int) -> None:
        """Drop a referenced block's hash: its owner is about to overwrite it."""
        assert self._ref_counts[block_id] > 0, f"uncaching unreferenced block {block_id}"
        block_hash = self._hashes[block_id]
        if block_hash is not None:
            del self._index[block_hash]
            self._note_removed(block_hash)
            self._hashes[block_id] = None

    def reset_prefix_cache(self) -> int:
        """Drop the hash of every evictable block, moving it to the free list. Returns how many were dropped.

        Referenced blocks keep their hashes: their contents are still valid.
        O(evictable blocks); for tests and benchmarks, not the step loop.
        """
        num_dropped = len(self._evictable)
        for block_id in self._evictable:
            block_hash = self._hashes[block_id]
            assert block_hash is not None
            del self._index[block_hash]
            self._note_removed(block_hash)
            self._hashes[block_id] = None
            self._free[block_id] = None
        self._evictable.clear()
        if num_dropped:
            logger.info("Prefix cache reset: dropped %d cached blocks", num_dropped)
        return num_dropped

    def take_index_delta(self) -> tuple[list[bytes], list[bytes]]:
        """The hashes the index gained and lost since the last call (net: a hash gained and lost in between
        is in neither). O(hashes changed); the engine takes it once per stats message."""
        delta, self._index_delta = self._index_delta, {}
        added = [block_hash for block_hash, gained in delta.items() if gained]
        removed = [block_hash for block_hash, gained in delta.items() if not gained]
        return added, removed

    def _note_removed(self, block_hash: bytes) -> None:
        if self._index_delta.pop(block_hash, None) is None:  # (gained then lost: no net change)
            self._index_delta[block_hash] = False

    # -------------------------------------------------------------- checking

    def check_invariants(self) -> None:
        """Assert the pool's internal consistency. O(num_blocks); for tests."""
        assert not (self._free.keys() & self._evictable.keys()), "block both free and evictable"
        num_referenced = 0
        for block_id in range(self._num_blocks):
            ref_count = self._ref_counts[block_id]
            block_hash = self._hashes[block_id]
            assert ref_count >= 0, (block_id, ref_count)
            if ref_count > 0:
                num_referenced += 1
                assert not self.is_available(block_id), f"referenced block {block_id} is on a free list"
            elif block_hash is None:
                assert block_id in self._free, f"unreferenced uncached block {block_id} is not free"
            else:
                assert block_id in self._evictable, f"unreferenced cached block {block_id} is not evictable"
            if block_hash is not None:
                assert self._index.get(block_hash) == block_id, f"hash of block {block_id} maps elsewhere"
        assert num_referenced + self.num_free_blocks == self._num_blocks
        for block_id in range(self._num_touched, self._num_blocks):
            assert self._ref_counts[block_id] == 0 and self._hashes[block_id] is None, f"untouched {block_id} in use"
        for block_hash, block_id in self._index.items():
            assert self._hashes[block_id] == block_hash, f"index entry for block {block_id} is stale"
