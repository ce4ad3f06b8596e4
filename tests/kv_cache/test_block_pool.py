"""BlockPool: ref counts, the free list, LRU eviction of cached blocks and the hash index."""

from __future__ import annotations

import pytest

from tokenmill.kv_cache import BlockPool


def h(n: int) -> bytes:
    return n.to_bytes(32, "little")


def test_fresh_pool_hands_out_every_block_once() -> None:
    pool = BlockPool(8)
    assert pool.num_free_blocks == 8
    block_ids = pool.allocate(8)
    assert sorted(block_ids) == list(range(8))
    assert pool.num_free_blocks == 0
    assert all(pool.ref_count(b) == 1 and not pool.is_available(b) for b in block_ids)
    pool.free(block_ids)
    assert pool.num_free_blocks == 8
    pool.check_invariants()


def test_freed_blocks_are_reused_before_untouched_ones() -> None:
    """The pool's memory is touched only as far as the load needs: a steady load of two blocks at a time keeps
    using the same two, however long it runs, and unused blocks go out lowest id first."""
    pool = BlockPool(100)
    assert pool.num_touched_blocks == 0
    assert pool.allocate(2) == [0, 1]
    for _ in range(50):
        first = pool.allocate(1)
        pool.free(first)
        again = pool.allocate(1)
        assert again == first
        pool.free(again)
    assert pool.num_touched_blocks == 3
    pool.free([0, 1])
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3] and pool.num_touched_blocks == 4
    pool.check_invariants()


def test_shared_block_is_free_only_after_its_last_reference() -> None:
    pool = BlockPool(4)
    (block_id,) = pool.allocate(1)
    pool.touch([block_id])
    pool.free([block_id])
    assert pool.ref_count(block_id) == 1 and pool.num_free_blocks == 3
    pool.free([block_id])
    assert pool.ref_count(block_id) == 0 and pool.num_free_blocks == 4
    pool.check_invariants()


def test_cached_blocks_become_evictable_and_are_used_last_oldest_first() -> None:
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    for n, block_id in enumerate((a, b, c)):
        assert pool.cache_block(block_id, h(n))
    pool.free([b, a, d, c])  # b reaches 0 first, then a, then d (uncached), then c
    assert pool.num_evictable_blocks == 3 and pool.num_cached_blocks == 3
    # The uncached block goes first, then evictable ones in the order they were freed.
    assert pool.allocate(1) == [d]
    assert pool.allocate(1) == [b]
    assert pool.get_cached_block(h(1)) is None and pool.block_hash(b) is None
    assert pool.get_cached_block(h(0)) == a and pool.num_cached_blocks == 2
    pool.check_invariants()


def test_touch_takes_a_cached_block_back_off_the_lru_list() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(0))
    pool.cache_block(b, h(1))
    pool.free([a, b])
    pool.touch([a])
    assert pool.ref_count(a) == 1 and not pool.is_available(a)
    pool.free([a])  # a is now the most recently freed
    assert pool.allocate(1) == [b]
    pool.check_invariants()


def test_existing_hash_wins() -> None:
    pool = BlockPool(3)
    a, b, _ = pool.allocate(3)
    assert pool.cache_block(a, h(7))
    assert not pool.cache_block(b, h(7))
    assert not pool.cache_block(a, h(8))  # a block keeps its first hash
    assert pool.get_cached_block(h(7)) == a and pool.block_hash(b) is None
    pool.uncache_block(a)
    assert pool.get_cached_block(h(7)) is None and pool.num_cached_blocks == 0
    pool.check_invariants()


def test_reset_drops_only_unreferenced_hashes() -> None:
    pool = BlockPool(3)
    a, b, _ = pool.allocate(3)
    pool.cache_block(a, h(0))
    pool.cache_block(b, h(1))
    pool.free([a])
    assert pool.reset_prefix_cache() == 1
    assert pool.get_cached_block(h(0)) is None and pool.get_cached_block(h(1)) == b
    assert pool.num_evictable_blocks == 0 and pool.num_free_blocks == 1
    pool.check_invariants()


def test_invalid_size() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_index_delta_is_the_net_change_since_the_last_take() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    assert pool.take_index_delta() == ([], [])
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(2))
    assert pool.cache_block(c, h(2)) is False  # the existing entry wins: no change reported
    assert pool.take_index_delta() == ([h(1), h(2)], [])
    assert pool.take_index_delta() == ([], [])
    pool.uncache_block(a)  # h(1) lost ...
    pool.cache_block(a, h(1))  # ... and back before anyone looked: no net change
    pool.cache_block(c, h(3))
    pool.uncache_block(c)  # gained and lost in between: nothing
    pool.free([b, c])
    (reused,) = pool.allocate(1)  # c was free: no eviction yet
    pool.free([reused])
    assert pool.take_index_delta() == ([], [])
    pool.allocate(2)  # takes the free block, then evicts b, which held h(2)
    assert pool.take_index_delta() == ([], [h(2)])
    pool.free([a])
    pool.reset_prefix_cache()
    assert pool.take_index_delta() == ([], [h(1)])
    pool.check_invariants()
