"""``check_kv_cache_manager`` and ``check_kv_tier``: the KV cache's bookkeeping and the stores below it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenmill.kv_cache.manager import KVCacheManager, PrefixMatch, SlotAllocation
from tokenmill.testing.conformance._util import conformance_check, fail

if TYPE_CHECKING:
    import torch

    from tokenmill.kv_cache.tier import KVTier


@conformance_check
def check_kv_cache_manager(
    manager: Callable[..., KVCacheManager], *, num_blocks: int = 16, block_size: int = 4
) -> None:
    """Check a KV cache manager against the ``KVCacheManager`` contract, in the scheduler's call order.

    Block tables grow to cover their tokens with distinct blocks of the pool, disjoint between requests;
    ``usage`` is the fraction of blocks referenced; an allocation that does not fit returns None and changes
    nothing; filled blocks published with ``cache_full_blocks`` are found by ``lookup_prefix`` (never the
    whole prompt, never under another ``cache_salt``, never with prefix caching off) and shared by a request
    that attaches them; ``fork`` shares a table and the first write into a shared block is copied; ``free``
    returns every block (unknown ids are ignored), after which the whole pool can be allocated again.

    :param manager: the class or a factory, called as the engine builds a manager without KV tiers:
        ``manager(num_blocks, block_size, enable_prefix_caching=..., hash_salt=...)`` (no ``tiers=``).
    :raises AssertionError: naming the call and what went wrong.
    """
    kv = manager(num_blocks, block_size, enable_prefix_caching=True, hash_salt="conformance")
    name = type(kv).__name__
    if kv.block_size != block_size or kv.usage != 0:
        fail(f"{name}: a new manager reports block_size={kv.block_size} and usage={kv.usage}, expected "
             f"{block_size} and 0")  # fmt: skip

    def allocate(request_id: str, computed: int, new: int, prefix: PrefixMatch | None = None) -> SlotAllocation:
        allocation = kv.allocate_slots(request_id, computed, new, prefix)
        if allocation is None:
            fail(f"{name}.allocate_slots({request_id!r}, {computed}, {new}) returned None with room to spare")
        table = kv.block_ids(request_id)
        needed = -(-(computed + new) // block_size)
        if len(table) != needed or len(set(table)) != len(table) or not all(0 <= b < num_blocks for b in table):
            fail(f"{name}: after allocate_slots({request_id!r}, {computed}, {new}) its block table is {table}; "
                 f"expected {needed} distinct block ids in [0, {num_blocks})")  # fmt: skip
        return allocation

    def expect_usage(num_held: int, when: str) -> None:
        if abs(kv.usage - num_held / num_blocks) > 1e-9:
            fail(f"{name}: usage is {kv.usage} {when}; {num_held} of {num_blocks} blocks are referenced")

    tokens_a = list(range(1000, 1013))  # 13 tokens: 3 full blocks and one partial
    first = allocate("a", 0, 10)
    if first.new_block_ids != kv.block_ids("a") or first.copies:
        fail(f"{name}: the first allocate_slots reported new_block_ids={first.new_block_ids} and copies="
             f"{first.copies}, expected the whole table {kv.block_ids('a')} and no copies")  # fmt: skip
    if allocate("a", 10, 1).new_block_ids:
        fail(f"{name}: allocate_slots reported new blocks although the table already covered 11 tokens")
    allocate("a", 11, 2)
    allocate("b", 0, 8)
    if set(kv.block_ids("a")) & set(kv.block_ids("b")):
        fail(f"{name}: requests 'a' and 'b' share blocks {set(kv.block_ids('a')) & set(kv.block_ids('b'))}")
    expect_usage(6, "with tables of 4 and 2 blocks")

    free_blocks = num_blocks - 6
    tables = {r: kv.block_ids(r) for r in ("a", "b")}
    if kv.allocate_slots("too-big", 0, (free_blocks + 1) * block_size) is not None:
        fail(f"{name}: allocate_slots succeeded for {free_blocks + 1} blocks with only {free_blocks} free")
    if kv.allocate_slots("b", 8, (free_blocks + 1) * block_size) is not None:
        fail(f"{name}: allocate_slots grew 'b' by {free_blocks + 1} blocks with only {free_blocks} free")
    if {r: kv.block_ids(r) for r in ("a", "b")} != tables:
        fail(f"{name}: an allocate_slots that returned None changed a block table")
    expect_usage(6, "after allocations that did not fit")

    kv.cache_full_blocks("a", tokens_a, 13)
    prefix = kv.lookup_prefix(tokens_a)
    if prefix.block_ids != kv.block_ids("a")[:3] or prefix.num_tokens != 3 * block_size:
        fail(f"{name}: lookup_prefix of request 'a''s 13 tokens found {prefix.block_ids} ({prefix.num_tokens} "
             f"tokens) after cache_full_blocks; expected its 3 full blocks {kv.block_ids('a')[:3]}")  # fmt: skip
    whole = kv.lookup_prefix(tokens_a[:12])
    if whole.num_tokens >= 12 or whole.num_tokens != len(whole.block_ids) * block_size:
        fail(f"{name}: lookup_prefix of a 12-token prompt matched {whole.num_tokens} tokens in "
             f"{len(whole.block_ids)} blocks; the last prompt token must be left to compute")  # fmt: skip
    if kv.lookup_prefix(tokens_a, cache_salt="another tenant").num_tokens:
        fail(f"{name}: lookup_prefix matched blocks cached under another cache_salt")
    allocate("c", prefix.num_tokens, 3, prefix)
    if kv.block_ids("c")[:3] != prefix.block_ids:
        fail(f"{name}: a request attaching a prefix got table {kv.block_ids('c')}, not starting {prefix.block_ids}")
    expect_usage(7, "after a request shared 3 cached blocks and added 1")

    kv.fork("a", "a#1")
    if kv.block_ids("a#1") != kv.block_ids("a"):
        fail(f"{name}: fork gave 'a#1' table {kv.block_ids('a#1')}, not the parent's {kv.block_ids('a')}")
    table_a = kv.block_ids("a")
    copied = allocate("a#1", 13, 1)
    if len(copied.copies) != 1 or copied.copies[0][0] != table_a[3] or kv.block_ids("a") != table_a:
        fail(f"{name}: the first write into the shared partial block {table_a[3]} after fork reported copies "
             f"{copied.copies}; expected one copy from it to a new block, the parent's table unchanged")  # fmt: skip
    if kv.block_ids("a#1")[3] != copied.copies[0][1] or kv.block_ids("a#1")[:3] != table_a[:3]:
        fail(f"{name}: after the copy the fork's table is {kv.block_ids('a#1')}; expected the parent's full "
             f"blocks then the copy's destination")  # fmt: skip

    for request_id in ("a", "b", "c", "a#1", "never-allocated"):
        kv.free(request_id)
    expect_usage(0, "after every request was freed")
    if kv.allocate_slots("everything", 0, num_blocks * block_size) is None:
        fail(f"{name}: after every request was freed, the pool's {num_blocks} blocks cannot be allocated")
    kv.free("everything")

    off = manager(num_blocks, block_size, enable_prefix_caching=False, hash_salt="conformance")
    allocate_off = off.allocate_slots("a", 0, 13)
    off.cache_full_blocks("a", tokens_a, 13)
    if allocate_off is None or off.lookup_prefix(tokens_a).num_tokens:
        fail(f"{name}: with enable_prefix_caching=False, lookup_prefix still matched cached blocks")


@conformance_check
def check_kv_tier(
    tier: Callable[..., KVTier],
    *,
    block_shape: tuple[int, ...] = (2, 2, 4, 2, 8),
    capacity_blocks: int = 3,
    dtype: torch.dtype | None = None,
) -> None:
    """Check a KV tier against the ``KVTier`` contract (``tokenmill.kv_cache.tier``).

    ``fetch`` after ``store`` returns an equal tensor even if the caller reuses its block; an unknown hash
    gives None without raising; ``contains`` agrees with ``fetch``; storing more than ``capacity_bytes``
    (``capacity_blocks`` blocks of ``block_shape``) evicts the least recently used block first (a fetch
    counts as a use); ``prefetch`` of stored blocks says ready within 10 s; ``stats`` counts hits and misses of
    ``fetch``; ``close`` can be called.

    A tier that passes evicted blocks on returns exactly the evicted one from the ``store`` that evicted it;
    ``fetch`` of a hash just evicted returns None and ``contains`` agrees.

    :param tier: the class or a factory, called as ``tier(capacity_bytes=..., fingerprint=...)``; a tier that
        needs a ``path`` is given as a factory (``functools.partial(DiskKVTier, path=tmp_path)``).
    :raises AssertionError: naming the call and what went wrong.
    """
    import torch

    dtype = dtype or torch.float16
    generator = torch.Generator().manual_seed(0)
    blocks = [torch.randn(block_shape, generator=generator).to(dtype) for _ in range(capacity_blocks + 1)]
    block_bytes = blocks[0].numel() * blocks[0].element_size()
    store = tier(capacity_bytes=capacity_blocks * block_bytes, fingerprint="conformance")
    name = type(store).__name__
    hashes = [bytes([i]) * 16 for i in range(len(blocks))]

    if store.fetch(b"\xff" * 16) is not None or store.contains(b"\xff" * 16):
        fail(f"{name}: fetch or contains of a hash never stored did not return None / False")
    for block_hash, block in zip(hashes[:capacity_blocks], blocks, strict=False):
        reused = block.clone()
        if store.store(block_hash, reused):
            fail(f"{name}: store within capacity returned evicted blocks")
        reused.zero_()  # the caller may reuse its buffer once store returns
    deadline = time.monotonic() + 10
    while not store.prefetch(hashes[:capacity_blocks]):  # a slow tier reads in the background meanwhile
        if time.monotonic() > deadline:
            fail(f"{name}: prefetch of stored blocks still said not ready after 10 s")
        time.sleep(0.01)
    for i in range(capacity_blocks):
        got = store.fetch(hashes[i])
        if not store.contains(hashes[i]) or got is None:
            fail(f"{name}: block {i} was stored within capacity but contains/fetch do not find it")
        if got.shape != blocks[i].shape or got.dtype != blocks[i].dtype or not torch.equal(got.cpu(), blocks[i]):
            fail(f"{name}: fetch returned a different block than was stored (was the caller's tensor kept "
                 "rather than copied?)")  # fmt: skip
    store.fetch(hashes[0])  # block 0 is now the most recently used: block 1 goes first
    passed_on = store.store(hashes[-1], blocks[-1].clone())
    present = [store.contains(h) for h in hashes]
    if present[1] or not present[0] or not present[-1]:
        fail(f"{name}: storing one block past capacity left blocks {[i for i, p in enumerate(present) if p]}; "
             "expected the least recently used one (1) evicted and the new one kept")  # fmt: skip
    if not isinstance(passed_on, list) or any(
        h != hashes[1] or not torch.equal(b.cpu(), blocks[1]) for h, b in passed_on
    ):
        fail(f"{name}: the store past capacity returned {passed_on!r}; expected [] or [(hash of block 1, block 1)]")
    if store.fetch(hashes[1]) is not None:
        fail(f"{name}: contains says block 1 was evicted, but fetch still returns it")
    hits, misses = store.stats.hits, store.stats.misses
    store.fetch(hashes[0])
    store.fetch(b"\xee" * 16)
    if (store.stats.hits - hits, store.stats.misses - misses) != (1, 1):
        fail(f"{name}: one hit and one miss of fetch changed stats by hits +{store.stats.hits - hits}, "
             f"misses +{store.stats.misses - misses}")  # fmt: skip
    store.close()
