"""Property-based tests: random scheduler-like operation sequences against a model of the KV contents.

Besides the bookkeeping invariants, the machine simulates the KV tensors: each
slot holds the key ``(cache_salt, token_ids[: p + 1])`` of the token written
there (its K/V depend on every token up to it and on the adapter). After every
operation each request must read its own tokens back through its block table,
and every prefix hit must point at blocks holding exactly the looked-up tokens.
That catches a block handed out twice, evicted while in use, written while
shared, or cached under the wrong hash.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.kv_cache.kv_util import snapshot
from tokenmill.kv_cache import PagedKVCacheManager, PrefixMatch, SlotAllocation

BS = 4
NUM_BLOCKS = 12
SALTS = [None, "tenant"]

# Prompts share leading blocks often, so prefix hits, evictions and duplicate hashes all happen.
_STEMS = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 8]
prompts = st.builds(
    lambda stem, tail: (stem + tail) or [0],
    st.sampled_from(_STEMS),
    st.lists(st.integers(0, 3), max_size=9),
)

Key = tuple[str | None, tuple[int, ...]]


@dataclass
class _Request:
    token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None

    def key(self, position: int) -> Key:
        return (self.cache_salt, tuple(self.token_ids[: position + 1]))


class KVCacheMachine(RuleBasedStateMachine):
    enable_prefix_caching = True

    def __init__(self) -> None:
        super().__init__()
        self.manager = PagedKVCacheManager(NUM_BLOCKS, BS, self.enable_prefix_caching, hash_salt="model")
        self.requests: dict[str, _Request] = {}
        self.kv: list[list[Key | None]] = [[None] * BS for _ in range(NUM_BLOCKS)]  # simulated KV slots
        self.next_id = 0

    # ------------------------------------------------------------ helpers

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _check_match(self, token_ids: list[int], cache_salt: str | None, match: PrefixMatch) -> None:
        assert match.num_tokens == len(match.block_ids) * BS
        assert match.num_tokens <= max(0, (len(token_ids) - 1) // BS) * BS
        assert len(set(match.block_ids)) == len(match.block_ids)
        if not self.enable_prefix_caching:
            assert match.block_ids == []
        for p in range(match.num_tokens):
            assert self.kv[match.block_ids[p // BS]][p % BS] == (cache_salt, tuple(token_ids[: p + 1])), p

    def _run(
        self, request_id: str, request: _Request, num_new: int, allocation: SlotAllocation, old: list[int]
    ) -> None:
        """Check what allocate_slots reported against the table, then "run the forward": apply copies, write K/V."""
        table = self.manager.block_ids(request_id)
        expected = list(old)
        for src, dst in allocation.copies:
            assert dst not in old and self.manager._pool.ref_count(dst) == 1
            expected[old.index(src)] = dst
            self.kv[dst] = list(self.kv[src])
        assert table == expected + allocation.new_block_ids
        assert len(table) * BS >= request.num_computed_tokens + num_new
        for p in range(request.num_computed_tokens, request.num_computed_tokens + num_new):
            block_id = table[p // BS]
            # Copy-on-write: nobody ever writes into a block that another table can read.
            assert self.manager._pool.ref_count(block_id) == 1, (block_id, p)
            self.kv[block_id][p % BS] = request.key(p)
        request.num_computed_tokens += num_new

    def _cache(self, request_id: str) -> None:
        request = self.requests[request_id]
        self.manager.cache_full_blocks(request_id, request.token_ids, request.num_computed_tokens, request.cache_salt)

    def _count_evictions(self, before: object) -> None:
        num_cached_before = len(before[4])  # type: ignore[index]
        event(f"allocation evicted cached blocks: {self.manager.num_cached_blocks < num_cached_before}")

    # -------------------------------------------------------------- rules

    @rule(prompt=prompts, cache_salt=st.sampled_from(SALTS), chunk=st.integers(1, 12), cache_after=st.booleans())
    def add_request(self, prompt: list[int], cache_salt: str | None, chunk: int, cache_after: bool) -> None:
        queries, hits = self.manager.prefix_cache_queries, self.manager.prefix_cache_hits
        match = self.manager.lookup_prefix(prompt, cache_salt)
        self._check_match(prompt, cache_salt, match)
        assert self.manager.prefix_cache_queries == queries + (len(prompt) if self.enable_prefix_caching else 0)
        request_id = self._new_id()
        num_new = min(chunk, len(prompt) - match.num_tokens)
        before = snapshot(self.manager)
        allocation = self.manager.allocate_slots(request_id, match.num_tokens, num_new, match)
        event(f"add_request: prefix hit {bool(match.block_ids)}, allocated {allocation is not None}")
        if allocation is None:
            assert snapshot(self.manager) == before
            return
        self._count_evictions(before)
        assert self.manager.prefix_cache_hits == hits + match.num_tokens
        assert allocation.copies == [] and allocation.new_block_ids[: len(match.block_ids)] == match.block_ids
        request = self.requests[request_id] = _Request(list(prompt), match.num_tokens, cache_salt)
        self._run(request_id, request, num_new, SlotAllocation(allocation.new_block_ids, []), [])
        if cache_after:  # what the scheduler does after each step
            self._cache(request_id)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:  # one scheduled step of one request
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        request = self.requests[request_id]
        remaining = len(request.token_ids) - request.num_computed_tokens
        if remaining > 0:  # still reading its prompt: a chunk of it
            num_new = data.draw(st.integers(1, remaining))
        else:  # generating: sample a token, compute it next step
            request.token_ids.append(data.draw(st.integers(0, 3)))
            num_new = 1
        old = self.manager.block_ids(request_id)
        before = snapshot(self.manager)
        allocation = self.manager.allocate_slots(request_id, request.num_computed_tokens, num_new)
        event(f"step: allocated {allocation is not None}, copied {bool(allocation and allocation.copies)}")
        if allocation is None:
            assert snapshot(self.manager) == before
            if remaining <= 0:
                request.token_ids.pop()
            return
        self._count_evictions(before)
        self._run(request_id, request, num_new, allocation, old)
        if data.draw(st.booleans(), label="cache_after"):
            self._cache(request_id)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        self._cache(request_id)
        before = snapshot(self.manager)
        self._cache(request_id)
        assert snapshot(self.manager) == before  # idempotent

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent_id = data.draw(st.sampled_from(sorted(self.requests)))
        parent = self.requests[parent_id]
        child_id = self._new_id()
        num_free = self.manager.num_free_blocks
        self.manager.fork(parent_id, child_id)
        assert self.manager.block_ids(child_id) == self.manager.block_ids(parent_id)
        assert self.manager.num_free_blocks == num_free  # sharing costs no blocks
        self.requests[child_id] = _Request(list(parent.token_ids), parent.num_computed_tokens, parent.cache_salt)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        freed = set(self.manager.block_ids(request_id))
        num_free = self.manager.num_free_blocks
        del self.requests[request_id]
        self.manager.free(request_id)
        still_held = {b for r in self.requests for b in self.manager.block_ids(r)}
        assert self.manager.num_free_blocks == num_free + len(freed - still_held)

    @rule(prompt=prompts, cache_salt=st.sampled_from(SALTS))
    def lookup(self, prompt: list[int], cache_salt: str | None) -> None:
        before = snapshot(self.manager)
        match = self.manager.lookup_prefix(prompt, cache_salt)
        self._check_match(prompt, cache_salt, match)
        assert snapshot(self.manager)[:-2] == before[:-2]  # only the query counter moves

    @rule()
    def reset_prefix_cache(self) -> None:
        is_empty = self.manager.reset_prefix_cache()
        assert is_empty == (self.manager.num_cached_blocks == 0)
        assert self.manager._pool.num_evictable_blocks == 0

    # ---------------------------------------------------------- invariants

    @invariant()
    def bookkeeping_agrees(self) -> None:
        manager = self.manager
        manager.check_invariants()
        pool = manager._pool
        tables = {request_id: manager.block_ids(request_id) for request_id in self.requests}
        counts = Counter(b for table in tables.values() for b in table)
        for block_id in range(NUM_BLOCKS):
            assert pool.ref_count(block_id) == counts[block_id]  # ref count == tables holding it
            assert pool.is_available(block_id) == (counts[block_id] == 0)  # free pool ∩ referenced = ∅
            block_hash = pool.block_hash(block_id)
            if block_hash is not None:
                assert pool.get_cached_block(block_hash) == block_id
        assert manager.num_free_blocks + len(counts) == NUM_BLOCKS
        assert abs(manager.usage - len(counts) / NUM_BLOCKS) < 1e-12
        # A private block (ref 1) belongs to exactly one table, so no two requests can write into the same block.
        private = [b for table in tables.values() for b in table if counts[b] == 1]
        assert len(private) == len(set(private))

    @invariant()
    def every_request_reads_its_own_tokens(self) -> None:
        for request_id, request in self.requests.items():
            table = self.manager.block_ids(request_id)
            for p in range(request.num_computed_tokens):
                assert self.kv[table[p // BS]][p % BS] == request.key(p), (request_id, p)

    def teardown(self) -> None:
        for request_id in list(self.requests):
            self.manager.free(request_id)
        self.manager.check_invariants()
        assert self.manager.usage == 0.0 and self.manager.num_free_blocks == NUM_BLOCKS


class KVCacheMachineNoPrefixCaching(KVCacheMachine):
    enable_prefix_caching = False


_settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestKVCacheManager = KVCacheMachine.TestCase
TestKVCacheManager.settings = _settings
TestKVCacheManagerNoPrefixCaching = KVCacheMachineNoPrefixCaching.TestCase
TestKVCacheManagerNoPrefixCaching.settings = _settings
