"""KVCacheManager: block tables, capacity, prefix reuse, salts, LRU eviction, copy-on-write, stats."""

from __future__ import annotations

import pytest

from tests.kv_cache.kv_util import prefill, snapshot
from tokenmill.kv_cache import PagedKVCacheManager, PrefixMatch, block_hashes

BS = 4
PROMPT_A = [1, 2, 3, 4, 5, 6, 7, 8]  # exactly two full blocks
PROMPT_B = [9, 10, 11, 12, 13, 14, 15, 16]


def make(num_blocks: int = 16, **kwargs: object) -> PagedKVCacheManager:
    return PagedKVCacheManager(num_blocks=num_blocks, block_size=BS, **kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------- allocate / free


def test_fresh_manager() -> None:
    manager = make(num_blocks=8)
    assert (manager.num_blocks, manager.block_size, manager.num_free_blocks) == (8, BS, 8)
    assert manager.usage == 0.0
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits, manager.num_cached_blocks) == (0, 0, 0)
    manager.check_invariants()


def test_allocate_then_free_returns_every_block() -> None:
    manager = make(num_blocks=16)
    first = manager.allocate_slots("a", 0, 10)
    second = manager.allocate_slots("b", 0, 5)
    assert first is not None and second is not None
    assert len(first.new_block_ids) == 3 and len(second.new_block_ids) == 2
    assert not set(first.new_block_ids) & set(second.new_block_ids)
    assert manager.block_ids("a") == first.new_block_ids
    assert manager.num_free_blocks == 11 and manager.usage == 5 / 16
    manager.check_invariants()
    manager.free("a")
    manager.free("b")
    assert manager.num_free_blocks == 16 and manager.usage == 0.0
    with pytest.raises(KeyError, match="'a'"):
        manager.block_ids("a")
    manager.check_invariants()


def test_decode_adds_a_block_only_when_the_last_one_is_full() -> None:
    manager = make()
    manager.allocate_slots("r", 0, 6)
    for num_computed, expect_new in [(6, False), (7, False), (8, True), (9, False)]:
        allocation = manager.allocate_slots("r", num_computed, 1)
        assert allocation is not None and allocation.copies == []
        assert bool(allocation.new_block_ids) is expect_new, num_computed
    assert len(manager.block_ids("r")) == 3
    # A step that needs no new slot (already covered) allocates nothing.
    assert manager.allocate_slots("r", 9, 0) == manager.allocate_slots("r", 8, 2)
    assert len(manager.block_ids("r")) == 3


def test_allocate_beyond_capacity_returns_none_and_changes_nothing() -> None:
    manager = make(num_blocks=8)
    prefill(manager, "old", PROMPT_A)
    manager.free("old")  # 2 evictable cached blocks
    assert manager.allocate_slots("big", 0, 20) is not None  # 5 blocks: 3 free remain (1 free + 2 evictable)
    before = snapshot(manager)
    assert manager.allocate_slots("other", 0, 13) is None  # needs 4
    assert manager.allocate_slots("big", 20, 13) is None  # needs 4 more
    assert snapshot(manager) == before
    with pytest.raises(KeyError):
        manager.block_ids("other")
    # Exactly the available number still fits, evicting the cached blocks.
    allocation = manager.allocate_slots("other", 0, 12)
    assert allocation is not None and manager.num_free_blocks == 0 and manager.num_cached_blocks == 0
    manager.check_invariants()


def test_attaching_evictable_prefix_blocks_counts_against_capacity() -> None:
    manager = make(num_blocks=8)
    prefill(manager, "old", PROMPT_A)
    manager.free("old")
    manager.allocate_slots("big", 0, 20)  # 1 free + 2 evictable left
    prompt = PROMPT_A + [20, 21, 22, 23, 24, 25, 26, 27]
    prefix = manager.lookup_prefix(prompt)
    assert prefix.num_tokens == 8
    before = snapshot(manager)
    # 2 prefix blocks come off the evictable list and 2 more are needed: 4 > 3.
    assert manager.allocate_slots("new", 8, 8, prefix) is None
    assert snapshot(manager) == before
    assert manager.prefix_cache_hits == 0  # hits count only reuse that happened
    allocation = manager.allocate_slots("new", 8, 4, prefix)  # 2 + 1 fits
    assert allocation is not None and manager.prefix_cache_hits == 8
    assert manager.num_free_blocks == 0
    manager.check_invariants()


# ------------------------------------------------------------------- prefix reuse


def test_second_request_reuses_the_cached_prefix() -> None:
    manager = make()
    _, first = prefill(manager, "a", PROMPT_A + [100, 101])
    prompt = PROMPT_A + [200]
    prefix, allocation = prefill(manager, "b", prompt)
    assert prefix.block_ids == first.new_block_ids[:2] and prefix.num_tokens == 8
    assert manager.block_ids("b")[:2] == manager.block_ids("a")[:2]
    assert manager.block_ids("b")[2] != manager.block_ids("a")[2]
    # The first call reports the attached prefix blocks followed by the new ones, and copies nothing.
    assert allocation.new_block_ids == manager.block_ids("b") and allocation.copies == []
    assert manager.prefix_cache_queries == 10 + 9 and manager.prefix_cache_hits == 8
    assert manager.usage == 4 / 16  # 3 blocks of a + 1 of b
    manager.check_invariants()


def test_lookup_never_covers_the_whole_prompt() -> None:
    manager = make()
    prefill(manager, "a", PROMPT_A + [9, 10, 11, 12])  # three full blocks cached
    assert manager.num_cached_blocks == 3
    assert manager.lookup_prefix(PROMPT_A).num_tokens == 4  # the last token must be computed
    assert manager.lookup_prefix(PROMPT_A + [9]).num_tokens == 8
    assert manager.lookup_prefix(PROMPT_A + [9, 10, 11, 12]).num_tokens == 8
    assert manager.lookup_prefix(PROMPT_A[:1]).num_tokens == 0
    assert manager.lookup_prefix([]).num_tokens == 0


def test_lookup_changes_nothing_but_the_query_count() -> None:
    manager = make()
    prefill(manager, "a", PROMPT_A)
    manager.free("a")
    before = snapshot(manager)
    queries = manager.prefix_cache_queries
    match = manager.lookup_prefix(PROMPT_A + [0])
    assert match.num_tokens == 8
    after = snapshot(manager)
    assert after[:-2] == before[:-2]  # everything but the counters
    assert manager.prefix_cache_queries == queries + 9 and manager.prefix_cache_hits == 0
    assert manager.num_free_blocks == 16  # the matched blocks are still evictable


def test_different_cache_salt_does_not_share() -> None:
    manager = make()
    prefill(manager, "a", PROMPT_A, cache_salt="tenant-1")
    assert manager.lookup_prefix(PROMPT_A + [0], cache_salt="tenant-1").num_tokens == 8
    assert manager.lookup_prefix(PROMPT_A + [0], cache_salt="tenant-2").num_tokens == 0
    assert manager.lookup_prefix(PROMPT_A + [0]).num_tokens == 0
    prefill(manager, "b", PROMPT_A, cache_salt="tenant-2")
    assert not set(manager.block_ids("a")) & set(manager.block_ids("b"))
    assert manager.num_cached_blocks == 4


def test_different_hash_salt_does_not_share() -> None:
    manager = make(hash_salt="model-1:bf16")
    prefill(manager, "a", PROMPT_A)
    pool = manager._pool
    # The index holds hashes salted with this manager's model, as a router computes them.
    assert pool.get_cached_block(block_hashes(PROMPT_A, BS, "model-1:bf16")[1]) == manager.block_ids("a")[1]
    assert all(pool.get_cached_block(x) is None for x in block_hashes(PROMPT_A, BS, "model-1:fp8"))
    assert all(pool.get_cached_block(x) is None for x in block_hashes(PROMPT_A, BS))


def test_prefix_caching_off() -> None:
    manager = make(enable_prefix_caching=False)
    prefill(manager, "a", PROMPT_A)
    assert manager.num_cached_blocks == 0
    prefix, _ = prefill(manager, "b", PROMPT_A + [0])
    assert prefix.num_tokens == 0 and not set(manager.block_ids("a")) & set(manager.block_ids("b"))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)
    manager.free("a")
    manager.free("b")
    assert manager.num_free_blocks == 16


def test_generated_tokens_are_cached_as_blocks_fill() -> None:
    manager = make()
    prompt = [1, 2, 3, 4, 5, 6]
    manager.allocate_slots("r", 0, 6)
    manager.cache_full_blocks("r", prompt, 6)
    assert manager.num_cached_blocks == 1
    tokens = list(prompt)
    for new_token in [7, 8, 9]:
        manager.allocate_slots("r", len(tokens), 1)
        tokens.append(new_token)
        manager.cache_full_blocks("r", tokens, len(tokens))
    assert manager.num_cached_blocks == 2
    assert manager.lookup_prefix(tokens).block_ids == manager.block_ids("r")[:2]


def test_cache_full_blocks_is_idempotent_and_keeps_the_existing_block() -> None:
    manager = make()
    for request_id in ("a", "b"):  # both computed before either is cached: two copies of the same prefix
        manager.allocate_slots(request_id, 0, 9)
    manager.cache_full_blocks("a", PROMPT_A + [0], 9)
    before = snapshot(manager)
    manager.cache_full_blocks("b", PROMPT_A + [0], 9)
    manager.cache_full_blocks("a", PROMPT_A + [0], 9)
    manager.cache_full_blocks("a", PROMPT_A + [0], 5)
    assert snapshot(manager)[:5] == before[:5]  # the pool is untouched: a's blocks stay cached, b's stay uncached
    assert manager.lookup_prefix(PROMPT_A + [0]).block_ids == manager.block_ids("a")[:2]
    manager.free("b")  # b's uncached blocks go straight to the free list
    assert manager.num_cached_blocks == 2 and manager._pool.num_evictable_blocks == 0
    manager.check_invariants()


# --------------------------------------------------------------------- eviction


def test_eviction_is_lru_and_tail_first() -> None:
    manager = make(num_blocks=8)
    prefill(manager, "a", PROMPT_A)
    prefill(manager, "b", PROMPT_B)
    a_blocks, b_blocks = manager.block_ids("a"), manager.block_ids("b")
    manager.free("a")
    manager.free("b")
    assert manager.num_free_blocks == 8 and manager.num_cached_blocks == 4
    # 4 uncached free blocks are used first; the 5th evicts a's tail block (a was freed first).
    allocation = manager.allocate_slots("c", 0, 20)
    assert allocation is not None and a_blocks[1] in allocation.new_block_ids
    assert manager.num_cached_blocks == 3
    assert manager.lookup_prefix(PROMPT_A + [0]).block_ids == a_blocks[:1]  # the root survives, its hash dropped
    assert manager.lookup_prefix(PROMPT_B + [0]).block_ids == b_blocks
    manager.allocate_slots("d", 0, 1)
    assert manager.block_ids("d") == a_blocks[:1]
    assert manager.lookup_prefix(PROMPT_A + [0]).num_tokens == 0
    manager.check_invariants()


def test_reusing_a_prefix_makes_it_recently_used() -> None:
    manager = make(num_blocks=8)
    prefill(manager, "a", PROMPT_A)
    prefill(manager, "b", PROMPT_B)
    a_blocks, b_blocks = manager.block_ids("a"), manager.block_ids("b")
    manager.free("a")
    manager.free("b")
    prefill(manager, "a2", PROMPT_A + [0])  # takes a's blocks back, plus one free block
    manager.free("a2")
    allocation = manager.allocate_slots("c", 0, 24)  # 4 free + 2 evicted: b's, not a's
    assert allocation is not None and set(b_blocks) <= set(allocation.new_block_ids)
    assert manager.lookup_prefix(PROMPT_A + [0]).block_ids == a_blocks


def test_stale_prefix_match_is_refused() -> None:
    manager = make(num_blocks=4)
    prefill(manager, "a", PROMPT_A)
    manager.free("a")
    prefix = manager.lookup_prefix(PROMPT_A + [0])
    manager.allocate_slots("other", 0, 16)  # evicts both cached blocks
    manager.free("other")
    with pytest.raises(ValueError, match="stale"):
        manager.allocate_slots("b", prefix.num_tokens, 1, prefix)
    manager.check_invariants()


# ---------------------------------------------------------------- copy-on-write


def test_fork_copies_a_shared_partial_block_on_first_write() -> None:
    manager = make()
    prefill(manager, "parent", [1, 2, 3, 4, 5, 6])  # block 1 holds 2 of 4 tokens
    parent_blocks = manager.block_ids("parent")
    manager.fork("parent", "child")
    assert manager.block_ids("child") == parent_blocks
    assert manager.usage == 2 / 16  # shared, not duplicated
    manager.check_invariants()
    allocation = manager.allocate_slots("child", 6, 1)
    assert allocation is not None and allocation.new_block_ids == []
    ((src, dst),) = allocation.copies
    assert src == parent_blocks[1] and dst not in parent_blocks
    assert manager.block_ids("child") == [parent_blocks[0], dst]
    assert manager.block_ids("parent") == parent_blocks
    manager.check_invariants()
    # The parent's block is private again: it writes in place.
    assert manager.allocate_slots("parent", 6, 1) == manager.allocate_slots("child", 7, 1)
    assert manager.allocate_slots("parent", 7, 1).copies == []  # type: ignore[union-attr]


def test_fork_never_copies_a_full_shared_block() -> None:
    manager = make()
    prefill(manager, "parent", PROMPT_A)
    manager.fork("parent", "child")
    child = manager.allocate_slots("child", 8, 1)
    parent = manager.allocate_slots("parent", 8, 1)
    assert child is not None and parent is not None
    assert child.copies == [] and parent.copies == []
    assert child.new_block_ids != parent.new_block_ids
    assert manager.block_ids("child")[:2] == manager.block_ids("parent")[:2]
    manager.check_invariants()


def test_copy_on_write_needs_a_free_block() -> None:
    manager = make(num_blocks=2)
    manager.allocate_slots("parent", 0, 6)
    manager.fork("parent", "child")
    before = snapshot(manager)
    assert manager.allocate_slots("child", 6, 1) is None
    assert snapshot(manager) == before


def test_freeing_parent_then_child_frees_everything() -> None:
    manager = make()
    prefill(manager, "parent", [1, 2, 3, 4, 5, 6])
    manager.fork("parent", "child")
    manager.allocate_slots("child", 6, 3)  # copy + one new block
    manager.free("parent")
    assert manager.usage == 3 / 16  # child's shared root, its copy and its new block
    manager.check_invariants()
    manager.free("child")
    assert manager.usage == 0.0 and manager.num_free_blocks == 16
    manager.check_invariants()


def test_rewinding_uncaches_the_block_being_rewritten() -> None:
    manager = make()
    prefill(manager, "r", PROMPT_A)
    assert manager.num_cached_blocks == 2
    allocation = manager.allocate_slots("r", 4, 4)  # recompute block 1
    assert allocation is not None and allocation.copies == []
    assert manager.num_cached_blocks == 1
    manager.cache_full_blocks("r", [1, 2, 3, 4, 0, 0, 0, 0], 8)
    assert manager.lookup_prefix([1, 2, 3, 4, 0, 0, 0, 0, 9]).num_tokens == 8
    assert manager.lookup_prefix(PROMPT_A + [9]).num_tokens == 4
    manager.check_invariants()


# ------------------------------------------------------------ errors and stats


def test_caller_mistakes_raise() -> None:
    manager = make()
    prefill(manager, "a", PROMPT_A)
    prefix = manager.lookup_prefix(PROMPT_A + [0])
    with pytest.raises(ValueError, match="num_computed_tokens"):
        manager.allocate_slots("b", 0, 9, prefix)
    with pytest.raises(ValueError, match="first allocate_slots"):
        manager.allocate_slots("a", 8, 1, prefix)
    with pytest.raises(ValueError, match="slots"):
        manager.allocate_slots("a", 9, 1)
    with pytest.raises(ValueError, match="cache_salt"):
        manager.cache_full_blocks("a", PROMPT_A + [0, 0, 0, 0], 8, cache_salt="x")
    with pytest.raises(ValueError, match="already has a block table"):
        manager.fork("a", "a")
    with pytest.raises(KeyError):
        manager.fork("missing", "c")
    with pytest.raises(ValueError, match="num_tokens"):
        manager.allocate_slots("b", 4, 1, PrefixMatch(block_ids=prefix.block_ids, num_tokens=4))
    manager.free("missing")  # no-op
    manager.check_invariants()


def test_salt_mismatch_with_the_lookup_is_caught_when_caching() -> None:
    manager = make()
    prefill(manager, "a", PROMPT_A, cache_salt="t")
    prefix = manager.lookup_prefix(PROMPT_A + [0], cache_salt="t")
    manager.allocate_slots("b", 8, 1, prefix)
    before = snapshot(manager)
    with pytest.raises(ValueError, match="cache_salt"):
        manager.cache_full_blocks("b", PROMPT_A + [0], 9, cache_salt=None)
    assert snapshot(manager) == before


def test_usage_counts_referenced_blocks_only() -> None:
    manager = make(num_blocks=10)
    prefill(manager, "a", PROMPT_A + [0])  # 3 blocks, 2 cached
    prefill(manager, "b", [5] * 5)  # 2 blocks
    assert manager.usage == 0.5 and manager.num_free_blocks == 5
    manager.free("a")  # 2 evictable + 1 free: both count as free, neither as used
    assert manager.usage == 0.2 and manager.num_free_blocks == 8 and manager.num_cached_blocks == 3


def test_reset_prefix_cache() -> None:
    manager = make()
    prefill(manager, "a", PROMPT_A)
    prefill(manager, "b", PROMPT_B)
    manager.free("a")
    assert manager.reset_prefix_cache() is False  # b still holds its cached blocks
    assert manager.lookup_prefix(PROMPT_A + [0]).num_tokens == 0
    assert manager.lookup_prefix(PROMPT_B + [0]).num_tokens == 8
    manager.free("b")
    assert manager.reset_prefix_cache() is True
    assert manager.num_cached_blocks == 0 and manager.num_free_blocks == 16
    assert manager.lookup_prefix(PROMPT_B + [0]).num_tokens == 0
    assert manager.prefix_cache_hits == 0 and manager.prefix_cache_queries > 0
    manager.check_invariants()
