"""KV tiers below the device cache: write-back on eviction, loads on a prefix miss, and exact outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.factories import make_engine, run_to_completion, save_hf_model
from tokenmill import hookimpl
from tokenmill.kv_cache import PagedKVCacheManager, block_hashes
from tokenmill.kv_cache.tier_stack import KVTierStack
from tokenmill.messages import EngineCoreRequest
from tokenmill.plugin_manager import load_plugins
from tokenmill.sampling_params import SamplingParams
from tokenmill.testing import DictKVTier

BS = 4


def _fill(manager: PagedKVCacheManager, request_id: str, tokens: list[int]) -> None:
    """Admit a request, 'compute' all its tokens, publish its blocks and finish it (blocks stay cached)."""
    prefix = manager.lookup_prefix(tokens)
    assert manager.allocate_slots(request_id, prefix.num_tokens, len(tokens) - prefix.num_tokens, prefix)
    manager.cache_full_blocks(request_id, tokens, len(tokens))
    manager.free(request_id)


def test_evicted_blocks_are_written_back_and_a_prefix_miss_loads_them() -> None:
    tier = DictKVTier(capacity_bytes=1 << 20)
    manager = PagedKVCacheManager(num_blocks=4, block_size=BS, hash_salt="m", tiers=KVTierStack([(tier, "eviction")]))
    first = list(range(100, 113))  # 3 full blocks + 1 token
    _fill(manager, "a", first)
    assert not manager.take_transfers()  # nothing evicted yet
    _fill(manager, "b", list(range(200, 216)))  # needs all 4 blocks: evicts a's 3 cached blocks
    transfers = manager.take_transfers()
    hashes = block_hashes(first, BS, "m")
    assert sorted(h for _, h in transfers.stores) == sorted(hashes) and not transfers.loads  # tail first
    # Each block's data says which block of the prompt it is.
    manager.store_blocks([(h, torch.full((2, 2, BS, 1, 1), float(hashes.index(h)))) for _, h in transfers.stores])
    assert all(tier.contains(h) for h in hashes)

    prefix = manager.lookup_prefix(first)  # the device cache misses; the tier has all three blocks
    assert (prefix.block_ids, prefix.num_tokens, list(prefix.tier_hashes)) == ([], 12, hashes)
    assert tier.stats.hits == 0  # looking up does no I/O: blocks are fetched when the request is admitted
    allocation = manager.allocate_slots("again", prefix.num_tokens, 1, prefix)
    assert allocation is not None
    loads = manager.take_transfers().loads
    assert tier.stats.hits == 3
    assert [block_id for block_id, _ in loads] == allocation.new_block_ids[:3]
    assert [float(data.flatten()[0]) for _, data in loads] == [0.0, 1.0, 2.0]
    manager.check_invariants()
    # Loaded blocks are cached under their hashes: the next lookup hits on the device.
    manager.cache_full_blocks("again", first, 13)
    assert manager.lookup_prefix(first).block_ids == allocation.new_block_ids[:3]


def _block(value: float) -> torch.Tensor:
    return torch.full((2, 2, BS, 1, 1), value)


def test_completion_tiers_get_every_computed_block_when_the_request_leaves() -> None:
    tier = DictKVTier(capacity_bytes=1 << 20)
    manager = PagedKVCacheManager(num_blocks=8, block_size=BS, hash_salt="m", tiers=KVTierStack([(tier, "completion")]))
    tokens = list(range(100, 113))  # 3 full blocks + 1 token
    _fill(manager, "a", tokens)
    transfers = manager.take_transfers()
    hashes = block_hashes(tokens, BS, "m")
    assert sorted(h for _, h in transfers.stores) == sorted(hashes)  # read off the device, not evicted
    assert [block_id for block_id, _ in transfers.stores] == [0, 1, 2]
    manager.store_blocks([(h, _block(1.0)) for _, h in transfers.stores])
    assert all(tier.contains(h) for h in hashes)
    _fill(manager, "b", tokens)  # a prefix hit: its blocks are in the tier already, nothing to read
    assert not manager.take_transfers()


def test_what_a_memory_tier_evicts_cascades_to_the_next_eviction_tier() -> None:
    block_bytes = _block(0).numel() * 4
    near, far = DictKVTier(capacity_bytes=2 * block_bytes), DictKVTier(capacity_bytes=1 << 20)
    stack = KVTierStack([(near, "eviction"), (far, "eviction")])
    for i in range(4):
        stack.store_evicted(bytes([i]), _block(float(i)))
    assert [near.contains(bytes([i])) for i in range(4)] == [False, False, True, True]
    assert [far.contains(bytes([i])) for i in range(4)] == [True, True, False, False]
    blocks = stack.fetch_all([bytes([0]), bytes([3])])  # each from the nearest tier holding it
    assert blocks is not None and [float(b.flatten()[0]) for b in blocks] == [0.0, 3.0]
    stack.loads_written()
    assert (near.stats.loads, far.stats.loads) == (0, 1)  # a load counts under the deepest tier it read from
    assert far.stats.load_seconds > 0 and stack.fetch_all([bytes([9])]) is None


def test_a_block_lost_between_lookup_and_admission_fails_the_admission_not_the_engine() -> None:
    tier = DictKVTier(capacity_bytes=1 << 20)
    manager = PagedKVCacheManager(num_blocks=8, block_size=BS, hash_salt="m", tiers=KVTierStack([(tier, "completion")]))
    tokens = list(range(100, 113))
    _fill(manager, "a", tokens)
    manager.store_blocks([(h, _block(1.0)) for _, h in manager.take_transfers().stores])
    manager.reset_prefix_cache()  # the device forgets; the tier still has the prefix
    prefix = manager.lookup_prefix(tokens)
    assert len(prefix.tier_hashes) == 3
    tier.close()  # the tier loses everything
    assert manager.allocate_slots("b", prefix.num_tokens, 1, prefix) is None
    manager.check_invariants()
    again = manager.lookup_prefix(tokens)  # the next lookup offers nothing from the tier: computed afresh
    assert again.num_tokens == 0 and manager.allocate_slots("b", 0, 13, again) is not None


def test_without_tiers_nothing_is_recorded() -> None:
    manager = PagedKVCacheManager(num_blocks=4, block_size=BS)
    _fill(manager, "a", list(range(13)))
    _fill(manager, "b", list(range(50, 66)))
    assert not manager.take_transfers()


class _DictTierPlugin:
    @hookimpl
    def tokenmill_register_kv_tiers(self, register):  # type: ignore[no-untyped-def]
        register("dict", "tokenmill.testing.kv_tier:DictKVTier")


@pytest.mark.slow
def test_an_engine_reloads_an_evicted_prefix_from_its_tier_with_identical_output(tmp_path: Path) -> None:
    save_hf_model("llama-tiny", tmp_path)
    plugins = load_plugins(autoload=False, extra_plugins=[("dict-tier", _DictTierPlugin())])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    long_prompt = [(7 * i) % 500 + 3 for i in range(40)]  # 10 blocks of 4
    others = [[(11 * i + j) % 500 + 3 for i in range(40)] for j in range(1, 4)]

    def run(**cache: object) -> tuple[list[list[int]], int]:
        from tokenmill.config import load_config
        from tokenmill.engine import EngineCore

        config = load_config(overrides={
            "model": {"model": str(tmp_path)}, "device": {"device": "cpu"},
            "cache": {"block_size": 4, "num_kv_blocks": 24}, **cache,
        })  # fmt: skip
        engine = EngineCore(config, plugins)
        results = []
        for round_, prompt in enumerate([long_prompt, *others, long_prompt]):  # the others evict it
            request = EngineCoreRequest(f"r{round_}", prompt, params, [], float(round_))
            results.append(run_to_completion(engine, [request])[f"r{round_}"])
        return results, sum(t.stats.hits for t in engine.kv_tiers)

    plain, no_hits = run()
    tiered, hits = run(kv_tiers=[{"name": "dict", "capacity": "16MiB", "write": "eviction"}])
    assert tiered == plain  # loading K/V from the tier changes no token
    assert no_hits == 0 and hits == 9  # the last request loaded its 9 reusable prefix blocks


def test_kv_tiers_entries_are_checked(tmp_path: Path) -> None:
    from tokenmill.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="must be 'NAME:CAPACITY\\[:PATH\\]', such as 'cpu:4GiB'"):
        load_config(overrides={"kv_tiers": ["cpu"]})
    with pytest.raises(ConfigError, match="kv_tiers entry 'cpu': capacity must be a size"):
        load_config(overrides={"kv_tiers": ["cpu:0.5"]})
    with pytest.raises(ConfigError, match="kv_tiers.*write"):
        load_config(overrides={"kv_tiers": [{"name": "cpu", "capacity": "1GiB", "write": "sometimes"}]})
    config = load_config(overrides={"kv_tiers": ["cpu:4GiB", "disk:20GiB:/var/cache/kv"]})
    assert [(t.name, t.capacity_bytes, t.path) for t in config.kv_tiers] == [
        ("cpu", 4 << 30, None),
        ("disk", 20 << 30, "/var/cache/kv"),
    ]
    assert load_config(overrides={"kv_tiers": [{"name": "cpu", "capacity": "4GiB"}]}) == load_config(
        overrides={"kv_tiers": ["cpu:4GiB"]}
    )
    written = tmp_path / "config.toml"  # `tokenmill config show` writes them as inline tables that read back
    written.write_text(config.to_toml())
    assert load_config(written).kv_tiers == config.kv_tiers
    plugins = load_plugins(autoload=False)
    from tokenmill.plugin_manager import PluginError

    with pytest.raises(PluginError, match="kv_tiers: unknown kv_tier 'cpu'; installed: none"):
        plugins.check_config(load_config(overrides={"kv_tiers": ["cpu:4GiB"]}))


def test_make_engine_accepts_no_tiers_by_default(tmp_path: Path) -> None:
    save_hf_model("llama-tiny", tmp_path)
    engine = make_engine(tmp_path)
    assert engine.kv_tiers == []
