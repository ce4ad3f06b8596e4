"""The KV cache manager: block tables of requests over a shared pool of blocks.

The model runner holds the KV tensors, ``num_blocks`` blocks of ``block_size``
tokens each. Token ``p`` of a request lives in block ``block_ids[p // block_size]``
at offset ``p % block_size``, where ``block_ids`` is the request's block table.
This module only does the bookkeeping: which blocks each request holds, how
many tables share each block, which full blocks are cached under a hash, and
which blocks the runner must copy before a step (copy-on-write). It never
touches tensors, so it needs no torch.

Call order, per request, from the scheduler in the engine process::

    prefix = lookup_prefix(prompt_token_ids, cache_salt)          # when admitting
    allocate_slots(request_id, prefix.num_tokens, n, prefix)      # first call attaches the prefix
    ... each step: allocate_slots(request_id, num_computed, n) -> run -> cache_full_blocks(...)
    fork(request_id, child_id)                                    # optional, n > 1 sampling
    free(request_id)                                              # finished, aborted or preempted
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from tokenmill.kv_cache.block_hash import hash_block, root_hash
from tokenmill.kv_cache.block_pool import BlockPool

if TYPE_CHECKING:
    from tokenmill.kv_cache.tier_stack import KVTierStack

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixMatch:
    """Cached full blocks matching a request's leading tokens, from ``lookup_prefix``."""

    block_ids: list[int]  # cached full blocks matching the request's leading tokens
    num_tokens: int  # (len(block_ids) + len(tier_hashes)) * block_size
    # The hash each block had at lookup time: allocate_slots refuses the match if one was evicted since.
    block_hashes: tuple[bytes, ...] = ()
    #: The hashes of the blocks that follow ``block_ids`` that a KV tier holds. ``allocate_slots`` fetches
    #: their data, gives each a device block and queues the data to be written there.
    tier_hashes: tuple[bytes, ...] = ()


@dataclass
class KVTransfers:
    """Block copies between the device cache and the KV tiers that must happen before a step's forward, in
    this order: ``stores`` (read blocks before anything overwrites them), then ``loads``."""

    #: ``(block_id, block_hash)`` of blocks to write to the tiers (evicted this step, or left with a finished
    #: request): the engine reads them off the device and passes them to ``store_blocks``.
    stores: list[tuple[int, bytes]] = field(default_factory=list)
    #: ``(block_id, data)``: blocks fetched from a tier, to write into these device blocks.
    loads: list[tuple[int, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


@dataclass(frozen=True)
class SlotAllocation:
    """What one ``allocate_slots`` call changed in a request's block table."""

    new_block_ids: list[int]  # blocks appended to the request's table by this call (prefix blocks on the first)
    copies: list[tuple[int, int]]  # copy-on-write: (src_block, dst_block) the runner must copy BEFORE the forward


@dataclass
class _RequestState:
    block_ids: list[int]
    # Chained hashes of the leading full blocks, by content; a block whose hash another block already held
    # stays uncached, but its hash is still the parent of the next one.
    block_hashes: list[bytes] = field(default_factory=list)
    cache_salt: str | None = None  # the salt block_hashes were computed with, once there are any


class KVCacheManager(ABC):
    """The bookkeeping of the paged KV cache: each request's block table, and the prefix cache.

    One per engine process, built by the engine at start-up once the number of blocks is known, as
    ``cls(num_blocks, block_size, enable_prefix_caching=..., hash_salt=...)``: the first two positional,
    plus ``tiers=`` (a ``KVTierStack``, the configured ``kv_tiers`` nearest first) only when there are KV
    tiers, and ``options=`` when its plugin declares options (a manager that takes no ``tiers`` works only
    without KV tiers). It is called only by the scheduler, from the engine loop, in the order the module
    docstring shows. No method may block, touch device memory or call hooks. ``hash_salt`` names the model
    and KV dtype: block hashes (``tokenmill.kv_cache.block_hash``) must be salted with it so that a router
    or KV tier computing them elsewhere gets the same values.
    """

    #: Registered name.
    name: ClassVar[str]

    @property
    @abstractmethod
    def block_size(self) -> int:
        """Tokens per block."""

    @property
    @abstractmethod
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, 0..1 (the KV-cache-usage gauge). Read once per step."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now, free or evictable. Read by the scheduler before it schedules a
        step while the last one still runs (async scheduling); a manager that does not say (0) is never
        scheduled ahead."""
        return 0

    @property
    def num_touched_blocks(self) -> int | None:
        """Blocks handed out at least once since start (on a CPU, the cache memory made resident): what the
        ``kv_cache_touched_bytes`` gauge reports. None (a manager that does not say) counts every block."""
        return None

    @abstractmethod
    def lookup_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PrefixMatch:
        """The longest run of leading full blocks of ``token_ids`` that is cached. Once per admission attempt."""

    @abstractmethod
    def allocate_slots(
        self, request_id: str, num_computed_tokens: int, num_new_tokens: int, prefix: PrefixMatch | None = None
    ) -> SlotAllocation | None:
        """Make the request's block table cover ``num_computed_tokens + num_new_tokens`` tokens, or return
        None and change nothing when blocks run out. Once per scheduled request per step, before it runs."""

    @abstractmethod
    def cache_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, cache_salt: str | None = None
    ) -> None:
        """Publish the request's filled blocks for reuse. Once per request that ran, after each step."""

    @abstractmethod
    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's block table, sharing every block (n > 1 sampling)."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Drop the request's block table (finished, aborted or preempted). Unknown ids: no-op."""

    @abstractmethod
    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table. Once per scheduled request per step."""

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Release the blocks of the request's table past those holding its first ``num_tokens`` tokens: the
        slots written for draft tokens the target rejected (speculative decoding). Called by the scheduler
        after a step that rejected drafts. The default keeps them: the request grows into them again."""

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache so far (a counter); 0 without a prefix cache."""
        return 0

    def take_transfers(self) -> KVTransfers:
        """The tier transfers queued since the last call (evictions to write back, prefix blocks to load).
        Called by the scheduler once per step, at the end of ``schedule``; none without KV tiers."""
        return KVTransfers()

    def store_blocks(self, blocks: list[tuple[bytes, Any]]) -> None:
        """Write the data of ``take_transfers().stores`` (read by the engine off the device) to the KV tiers."""

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens reused from the prefix cache so far (a counter)."""
        return 0

    def take_prefix_cache_delta(self) -> tuple[list[bytes], list[bytes]]:
        """The block hashes the prefix cache gained and lost since the last call, net (vLLM's KV events
        ``BlockStored``/``BlockRemoved``, compacted): what routers in the front end learn the cache holds.
        Called by the engine process once per stats message (after a step, or a heartbeat); O(hashes
        changed). The default reports nothing: prefix-aware routers then see no cached prefix here."""
        return [], []


class PagedKVCacheManager(KVCacheManager):
    """Block tables, ref counts, prefix caching and copy-on-write over one pool of KV blocks.

    One per engine process, built at startup once the number of blocks is known
    and called only by the scheduler, from the engine loop. No method blocks,
    touches device memory or calls hooks; each is O(blocks it touches) except
    ``reset_prefix_cache`` and ``check_invariants``.
    """

    name: ClassVar[str] = "paged"

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_salt: str = "",
        tiers: KVTierStack | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}; set cache.block_size")
        self._pool = BlockPool(num_blocks)
        # KV tiers, nearest first: blocks leave the device for them (on eviction or with a finished request)
        # and a prefix that misses on the device continues down them.
        self._tiers = tiers if tiers and enable_prefix_caching else None
        self._pool.record_evictions = self._tiers is not None and self._tiers.takes_evictions
        self._pending_loads: list[tuple[int, Any]] = []
        self._completed: dict[bytes, int] = {}  # hash -> block id of finished requests' blocks for the tiers
        self._evicted_hashes: set[bytes] = set()  # which of the stores handed out were evictions
        self._block_size = block_size
        self._enable_prefix_caching = enable_prefix_caching
        self._hash_salt = hash_salt  # names the model: every block hash is salted with it
        self._requests: dict[str, _RequestState] = {}
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        logger.info(
            "KV cache manager: %d blocks of %d tokens, prefix caching %s",
            num_blocks,
            block_size,
            "on" if enable_prefix_caching else "off",
        )

    # ------------------------------------------------------------ properties

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self._enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached ones. Read by the scheduler per step."""
        return self._pool.num_free_blocks

    @property
    def num_touched_blocks(self) -> int:
        return self._pool.num_touched_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, 0..1 (the KV-cache-usage gauge). Read per step."""
        return (self.num_blocks - self._pool.num_free_blocks) / self.num_blocks

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache so far (a counter)."""
        return self._prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens reused from the prefix cache so far (a counter)."""
        return self._prefix_cache_hits

    def take_prefix_cache_delta(self) -> tuple[list[bytes], list[bytes]]:
        return self._pool.take_index_delta()

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hash, referenced or evictable."""
        return self._pool.num_cached_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table. Called by the scheduler per scheduled request per step."""
        return list(self._state(request_id).block_ids)

    # --------------------------------------------------------- prefix cache

    def lookup_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PrefixMatch:
        """The longest run of leading full blocks of ``token_ids`` that is cached.

        Called by the scheduler when it tries to admit a waiting request (again
        after each failed admission). Changes nothing but the query counter
        (``len(token_ids)`` tokens; only while prefix caching is on). Never
        covers the whole prompt, at most ``(len(token_ids) - 1) // block_size``
        blocks, because the last prompt token must be computed to get logits.
        ``cache_salt`` names an adapter or tenant (None: none).
        """
        if not self._enable_prefix_caching:
            return PrefixMatch(block_ids=[], num_tokens=0)
        self._prefix_cache_queries += len(token_ids)
        block_size = self._block_size
        max_blocks = max(0, (len(token_ids) - 1) // block_size)
        block_ids: list[int] = []
        hashes: list[bytes] = []
        parent = root_hash(self._hash_salt, cache_salt)
        # Hash block by block and stop at the first miss: later blocks chain off it, so they cannot hit.
        for i in range(max_blocks):
            parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
            block_id = self._pool.get_cached_block(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
            hashes.append(parent)
        in_tiers = self._in_tiers(token_ids, len(block_ids), max_blocks, parent) if self._tiers else ()
        return PrefixMatch(
            block_ids=block_ids,
            num_tokens=(len(block_ids) + len(in_tiers)) * block_size,
            block_hashes=tuple(hashes),
            tier_hashes=in_tiers,
        )

    def _in_tiers(self, token_ids: Sequence[int], first: int, max_blocks: int, first_hash: bytes) -> tuple[bytes, ...]:
        """The hashes of blocks ``first``, ``first + 1``, ... of ``token_ids`` that a tier holds, until one is in
        none; ``first_hash`` is block ``first``'s hash (the device cache missed it). No I/O: data is fetched
        only when the request is admitted."""
        assert self._tiers is not None
        found: list[bytes] = []
        block_hash = first_hash
        for i in range(first, max_blocks):
            if i > first:
                block_hash = hash_block(block_hash, token_ids[i * self._block_size : (i + 1) * self._block_size])
            if not self._tiers.contains(block_hash):
                break
            found.append(block_hash)
        return tuple(found)

    def take_transfers(self) -> KVTransfers:
        evicted, self._pool.evicted = self._pool.evicted, []
        self._evicted_hashes = {block_hash for _, block_hash in evicted}
        completed = [(block_id, h) for h, block_id in self._completed.items() if h not in self._evicted_hashes]
        self._completed = {}
        transfers = KVTransfers(stores=evicted + completed, loads=self._pending_loads)
        self._pending_loads = []
        return transfers

    def store_blocks(self, blocks: list[tuple[bytes, Any]]) -> None:
        if self._tiers is None:
            return
        for block_hash, data in blocks:
            self._tiers.store_completed(block_hash, data)  # the tiers that take every computed block first
            if block_hash in self._evicted_hashes:
                self._tiers.store_evicted(block_hash, data)

    def cache_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, cache_salt: str | None = None
    ) -> None:
        """Register the request's completely filled blocks in the prefix index, so later requests can reuse them.

        Called by the scheduler after each step for each request that ran, with
        all its token ids so far (prompt + output) and its new
        ``num_computed_tokens``. Only blocks that filled up since the last call
        are hashed. Idempotent; a block already cached stays; if another block
        already holds a hash, that one is kept and this block stays uncached.
        ``cache_salt`` must be the one given to ``lookup_prefix``.
        """
        if not self._enable_prefix_caching:
            return
        state = self._state(request_id)
        block_size = self._block_size
        if num_computed_tokens > len(token_ids) or num_computed_tokens > len(state.block_ids) * block_size:
            raise ValueError(
                f"request {request_id!r}: num_computed_tokens={num_computed_tokens} exceeds its "
                f"{len(token_ids)} token ids or the {len(state.block_ids) * block_size} slots of its block table"
            )
        known = state.block_hashes
        if known and cache_salt != state.cache_salt:
            raise ValueError(
                f"request {request_id!r} was cached with cache_salt={state.cache_salt!r}, now {cache_salt!r}; "
                "pass the same cache_salt every time"
            )
        num_full_blocks = num_computed_tokens // block_size
        if num_full_blocks <= len(known):
            return
        # Compute and check every new hash before registering any, so a bad call changes nothing.
        parent = known[-1] if known else root_hash(self._hash_salt, cache_salt)
        new_hashes: list[bytes] = []
        for i in range(len(known), num_full_blocks):
            parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
            existing = self._pool.block_hash(state.block_ids[i])
            if existing is not None and existing != parent:
                raise ValueError(
                    f"request {request_id!r}: block {i} holds other tokens or salts than given "
                    f"(cache_salt={cache_salt!r} must match the one passed to lookup_prefix)"
                )
            new_hashes.append(parent)
        for i, block_hash in enumerate(new_hashes, start=len(known)):
            self._pool.cache_block(state.block_ids[i], block_hash)
        known.extend(new_hashes)
        state.cache_salt = cache_salt

    def reset_prefix_cache(self) -> bool:
        """Drop the hash of every unreferenced cached block. For tests and benchmarks, between runs.

        Returns True if the prefix cache is now empty, False if blocks still held
        by requests keep theirs. Counters are not reset (they are monotonic).
        """
        self._pool.reset_prefix_cache()
        return self._pool.num_cached_blocks == 0

    # ---------------------------------------------------------- block tables

    def allocate_slots(
        self, request_id: str, num_computed_tokens: int, num_new_tokens: int, prefix: PrefixMatch | None = None
    ) -> SlotAllocation | None:
        """Make the request's block table cover ``num_computed_tokens + num_new_tokens`` tokens.

        Called by the scheduler once per scheduled request per step, before the
        step runs. The first call for a request registers it: ``prefix`` (from
        ``lookup_prefix``, just before) attaches its cached blocks and
        ``num_computed_tokens`` must equal ``prefix.num_tokens`` (0 without one).
        Every existing block that this step writes into and that other tables
        share is replaced by a private copy, reported in ``copies`` (in practice
        only the block of position ``num_computed_tokens``, after a fork).
        Returns None and changes nothing if there are not enough free and
        evictable blocks (the scheduler then preempts someone, or for a waiting
        request waits), or while the prefix's blocks are still being read from a
        KV tier (the request waits; the running requests go on).
        """
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got {num_computed_tokens=} {num_new_tokens=}")
        block_size = self._block_size
        pool = self._pool
        state = self._requests.get(request_id)
        prefix_block_ids: list[int] = []
        if state is None:
            expected = prefix.num_tokens if prefix is not None else 0
            if num_computed_tokens != expected:
                raise ValueError(
                    f"request {request_id!r}: first allocate_slots needs num_computed_tokens == "
                    f"{expected} (the prefix's num_tokens), got {num_computed_tokens}"
                )
            if prefix is not None:
                self._check_prefix(prefix)
                prefix_block_ids = prefix.block_ids
            table = prefix_block_ids
        else:
            if prefix is not None and prefix.block_ids:
                raise ValueError(f"request {request_id!r}: a prefix can only be attached on the first allocate_slots")
            table = state.block_ids
            if num_computed_tokens > len(table) * block_size:
                raise ValueError(
                    f"request {request_id!r}: {num_computed_tokens} computed tokens but only "
                    f"{len(table) * block_size} slots were allocated"
                )

        num_needed = -(-(num_computed_tokens + num_new_tokens) // block_size)
        num_new_blocks = max(0, num_needed - len(table))
        # Existing blocks this step writes into; normally just the one holding position num_computed_tokens.
        first_written = num_computed_tokens // block_size
        written = range(first_written, min(len(table), num_needed)) if num_new_tokens else range(0)
        to_copy = [i for i in written if pool.ref_count(table[i]) > 1]
        num_revived = sum(1 for block_id in prefix_block_ids if pool.ref_count(block_id) == 0)
        if num_new_blocks + len(to_copy) + num_revived > pool.num_free_blocks:
            logger.debug(
                "Cannot allocate %d blocks for request %s: %d available",
                num_new_blocks + len(to_copy) + num_revived,
                request_id,
                pool.num_free_blocks,
            )
            return None
        loaded: list[Any] = []
        if state is None and prefix is not None and prefix.tier_hashes:
            assert self._tiers is not None, "a PrefixMatch with tier blocks from a manager without tiers"
            if not self._tiers.prefetch(prefix.tier_hashes):  # being read: the running requests go on meanwhile
                logger.debug("Request %s waits for its prefix to be read from a KV tier", request_id)
                return None
            fetched = self._tiers.fetch_all(prefix.tier_hashes)
            if fetched is None:  # gone since lookup_prefix: the next lookup will not offer it
                logger.debug("A KV tier lost a block of request %s's prefix since lookup; retrying", request_id)
                return None
            loaded = fetched

        # Enough room: from here on nothing fails. Attach the prefix before allocating so it cannot be evicted.
        if state is None:
            pool.touch(prefix_block_ids)
            state = self._requests[request_id] = _RequestState(block_ids=list(prefix_block_ids))
            if prefix is not None:
                self._prefix_cache_hits += prefix.num_tokens
        table = state.block_ids
        copies: list[tuple[int, int]] = []
        for i in written:
            src = table[i]
            if pool.ref_count(src) > 1:
                (dst,) = pool.allocate(1)
                pool.free([src])  # still referenced by the other tables
                table[i] = dst
                copies.append((src, dst))
            elif pool.block_hash(src) is not None:
                # Only reachable if the scheduler rewinds num_computed_tokens: the block's contents will change.
                pool.uncache_block(src)
        if num_new_tokens and len(state.block_hashes) > first_written:
            del state.block_hashes[first_written:]
        new_block_ids = pool.allocate(num_new_blocks)
        table.extend(new_block_ids)
        if loaded:
            assert prefix is not None
            # The first new blocks hold the tier's data once the engine has written it, before the forward:
            # publish them under their hashes like any computed full block.
            for block_id, block_hash, data in zip(new_block_ids, prefix.tier_hashes, loaded, strict=False):
                self._pending_loads.append((block_id, data))
                pool.cache_block(block_id, block_hash)
        if prefix_block_ids:
            new_block_ids = list(prefix_block_ids) + new_block_ids
        return SlotAllocation(new_block_ids=new_block_ids, copies=copies)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` a copy of the parent's block table, sharing every block (ref count +1).

        Called by the scheduler once per extra sequence when a request samples
        n > 1 sequences from one prompt, after the prompt is computed. The first
        write into a shared partial block is then copied (see ``allocate_slots``).
        """
        if child_id in self._requests:
            raise ValueError(f"cannot fork into {child_id!r}: that request already has a block table")
        parent = self._state(parent_id)
        self._pool.touch(parent.block_ids)
        self._requests[child_id] = _RequestState(
            block_ids=list(parent.block_ids), block_hashes=list(parent.block_hashes), cache_salt=parent.cache_salt
        )

    def free(self, request_id: str) -> None:
        """Drop the request's block table: each block loses a reference and at 0 returns to the pool.

        Called by the scheduler once per request when it finishes, is aborted
        or is preempted. Cached blocks stay reusable but become evictable, in
        LRU order; they are freed tail-first so that a shared prefix's first
        block is evicted last. Unknown ``request_id``: no-op.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        if self._tiers is not None:  # 'completion' tiers take the blocks it computed (read before any reuse)
            for block_id, block_hash in zip(state.block_ids, state.block_hashes, strict=False):
                if block_hash not in self._completed and self._tiers.needs_completed(block_hash):
                    self._completed[block_hash] = block_id
        self._pool.free(reversed(state.block_ids))

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Free the request's blocks past ``ceil(num_tokens / block_size)``, tail first (never cached: a block
        is published only once computed, and these hold rejected drafts). Unknown ``request_id``: no-op."""
        state = self._requests.get(request_id)
        if state is None:
            return
        keep = -(-num_tokens // self._block_size)
        if len(state.block_ids) > keep:
            self._pool.free(reversed(state.block_ids[keep:]))
            del state.block_ids[keep:]
            del state.block_hashes[keep:]

    # -------------------------------------------------------------- checking

    def check_invariants(self) -> None:
        """Assert that block tables, ref counts, free lists and the hash index agree. O(num_blocks); for tests."""
        self._pool.check_invariants()
        counts: Counter[int] = Counter()
        for request_id, state in self._requests.items():
            assert len(set(state.block_ids)) == len(state.block_ids), f"{request_id!r} holds a block twice"
            assert len(state.block_hashes) <= len(state.block_ids), request_id
            counts.update(state.block_ids)
            for block_id, block_hash in zip(state.block_ids, state.block_hashes, strict=False):
                assert self._pool.block_hash(block_id) in (None, block_hash), (request_id, block_id)
        for block_id in range(self.num_blocks):
            assert self._pool.ref_count(block_id) == counts[block_id], (
                f"block {block_id}: ref count {self._pool.ref_count(block_id)}, in {counts[block_id]} tables"
            )
        if not self._enable_prefix_caching:
            assert self._pool.num_cached_blocks == 0

    # ------------------------------------------------------------- helpers

    def _state(self, request_id: str) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise KeyError(f"request {request_id!r} has no block table (never allocated, or already freed)")
        return state

    def _check_prefix(self, prefix: PrefixMatch) -> None:
        num_blocks = len(prefix.block_ids) + len(prefix.tier_hashes)
        if prefix.num_tokens != num_blocks * self._block_size:
            raise ValueError(
                f"PrefixMatch.num_tokens={prefix.num_tokens} but {num_blocks} blocks of "
                f"{self._block_size} tokens; use lookup_prefix"
            )
        if prefix.block_hashes and len(prefix.block_hashes) != len(prefix.block_ids):
            raise ValueError("PrefixMatch.block_hashes must have one hash per block; use lookup_prefix")
        if prefix.block_ids and not self._enable_prefix_caching:
            raise ValueError("a non-empty PrefixMatch was given but prefix caching is off")
        for i, block_id in enumerate(prefix.block_ids):
            block_hash = self._pool.block_hash(block_id)
            if block_hash is None or (prefix.block_hashes and block_hash != prefix.block_hashes[i]):
                raise ValueError(
                    f"stale PrefixMatch: block {block_id} was evicted since lookup_prefix; "
                    "call lookup_prefix again right before allocate_slots"
                )
