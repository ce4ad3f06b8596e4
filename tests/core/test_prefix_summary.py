"""The prefix cache summary from engine to front end (``tokenmill.prefix_summary``): the engine's feed, the wire
(``EngineStatsMessage`` through the serde), and the front end's mirror, fed by a real KV cache manager."""

from __future__ import annotations

import random

import pytest

from tokenmill.kv_cache.block_hash import block_hashes
from tokenmill.kv_cache.manager import PagedKVCacheManager
from tokenmill.messages import PREFIX_KEY_SIZE, EngineCoreOutput, EngineCoreOutputs, EngineStatsMessage
from tokenmill.prefix_summary import ROUTED_PREFIX_TTL_S, PrefixCacheSummary, PrefixSummaryFeed, prefix_keys
from tokenmill.transport.serde import decode_from_engine, encode

BLOCK_SIZE = 4


def _over_the_wire(feed: PrefixSummaryFeed, peer: bytes, **stats: int) -> EngineStatsMessage:
    """The stats message ``peer`` gets next, encoded and decoded as the engine process and front end do."""
    seq, is_reset, added, removed = feed.take(peer)
    message = EngineStatsMessage(
        1, 2, 0.5, 3, 4, 5, 6, 7, prefix_cache_seq=seq, prefix_cache_reset=is_reset, prefix_cache_added=added,
        prefix_cache_removed=removed, **stats,
    )  # fmt: skip
    decoded = decode_from_engine(encode(EngineCoreOutputs([EngineCoreOutput("r", [1])], message)))
    assert isinstance(decoded, EngineCoreOutputs)
    return decoded.stats


def test_stats_message_round_trip_keeps_every_routing_field() -> None:
    feed = PrefixSummaryFeed()
    feed.reset(b"a")
    feed.update([bytes(range(32))], [])
    stats = _over_the_wire(feed, b"a", num_outstanding_tokens=1234, num_free_kv_blocks=56)
    assert (stats.num_outstanding_tokens, stats.num_free_kv_blocks) == (1234, 56)
    assert (stats.prefix_cache_seq, stats.prefix_cache_reset) == (1, True)
    assert stats.prefix_cache_added == bytes(range(PREFIX_KEY_SIZE)) and stats.prefix_cache_removed == b""
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (1, 2, 0.5)


def test_the_front_end_mirror_follows_a_real_cache_through_admissions_and_evictions() -> None:
    """Random prompts (some sharing prefixes) through a small paged cache, evicting as they go: after every
    message the mirror holds exactly the keys of the hashes the cache's index holds."""
    rng = random.Random(0)
    cache = PagedKVCacheManager(num_blocks=24, block_size=BLOCK_SIZE, hash_salt="m")
    feed, mirror = PrefixSummaryFeed(), PrefixCacheSummary()
    feed.reset(b"front-end")
    prefixes = [[rng.randrange(100) for _ in range(8)] for _ in range(3)]
    for number in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(1, 10))]
        request_id = f"r{number}"
        match = cache.lookup_prefix(prompt)
        if cache.allocate_slots(request_id, match.num_tokens, len(prompt) - match.num_tokens, match) is None:
            continue
        cache.cache_full_blocks(request_id, prompt, len(prompt))
        if rng.random() < 0.8:
            cache.free(request_id)
        if rng.random() < 0.5:  # not every step sends a message: deltas accumulate in between
            feed.update(*cache.take_prefix_cache_delta())
            assert mirror.apply(_over_the_wire(feed, b"front-end"))
            assert mirror.keys == {key[:PREFIX_KEY_SIZE] for key in cache._pool._index}
    assert 0 < len(mirror.keys) <= 24


def test_matching_blocks_stop_at_the_first_block_not_held() -> None:
    hashes = block_hashes(list(range(16)), BLOCK_SIZE)
    keys = prefix_keys(hashes)
    mirror = PrefixCacheSummary()
    feed = PrefixSummaryFeed()
    feed.update([hashes[0], hashes[1], hashes[3]], [])
    mirror.apply(_over_the_wire(feed, b"a"))
    assert mirror.num_matching_blocks(keys) == 2  # block 3 is held, but without block 2 it is no prefix
    assert mirror.num_matching_blocks(prefix_keys(block_hashes(list(range(16)), BLOCK_SIZE, "other model"))) == 0


def test_routed_prefixes_count_until_they_expire_or_are_reported() -> None:
    keys = prefix_keys(block_hashes(list(range(12)), BLOCK_SIZE))
    mirror = PrefixCacheSummary()
    mirror.note_routed(keys[:2], now=100.0)
    assert mirror.num_matching_blocks(keys, now=100.0 + ROUTED_PREFIX_TTL_S - 1) == 2
    assert mirror.num_matching_blocks(keys, now=100.0 + ROUTED_PREFIX_TTL_S + 1) == 0
    mirror.clear()
    assert mirror.num_matching_blocks(keys, now=100.0) == 0


@pytest.mark.parametrize("first_seq", [1, 7])
def test_a_gap_in_the_sequence_is_noticed(first_seq: int) -> None:
    mirror = PrefixCacheSummary()
    snapshot = EngineStatsMessage(0, 0, 0.0, 0, 0, 0, 0, 0, prefix_cache_seq=first_seq, prefix_cache_reset=True,
                                  prefix_cache_added=b"k" * 8)  # fmt: skip
    assert mirror.apply(snapshot) and mirror.keys == {b"k" * 8}
    next_one = EngineStatsMessage(0, 0, 0.0, 0, 0, 0, 0, 0, prefix_cache_seq=first_seq + 1,
                                  prefix_cache_removed=b"k" * 8)  # fmt: skip
    assert mirror.apply(next_one) and mirror.keys == set()
    skipped = EngineStatsMessage(0, 0, 0.0, 0, 0, 0, 0, 0, prefix_cache_seq=first_seq + 3,
                                 prefix_cache_added=b"j" * 8)  # fmt: skip
    assert not mirror.apply(skipped) and mirror.keys == set() and not mirror.is_synced
