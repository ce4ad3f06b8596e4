"""The first-party routers (plugins/tokenmill_plugins/routers) on synthetic engine states, their options, the
conformance check, and loading them through their entry point."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tokenmill_plugins.routers.options import RoutersOptions
from tokenmill_plugins.routers.policies import (
    KVAwareRouter,
    LeastLoadedRouter,
    LoRAAwareRouter,
    PrefixAwareRouter,
    is_imbalanced,
)

from tokenmill.lora.request import LoRARequest
from tokenmill.messages import EngineCoreRequest
from tokenmill.plugin_manager import PluginError, Slot, load_plugins
from tokenmill.routing import EngineState, RoundRobinRouter, least_loaded
from tokenmill.sampling_params import SamplingParams
from tokenmill.testing import check_router

PROMPT_LEN = 64


def _request(prompt_len: int = PROMPT_LEN, lora_name: str | None = None) -> EngineCoreRequest:
    lora = LoRARequest(lora_name, 1 + ord(lora_name[0]), f"/adapters/{lora_name}") if lora_name else None
    return EngineCoreRequest("r", list(range(prompt_len)), SamplingParams(), [0], 0.0, lora_request=lora)


def _engine(index: int, outstanding: int = 0, free_kv: int = 0, cached: int = 0, healthy: bool = True,
            in_flight: int = 0, adapters: str = "", max_loras: int = 0) -> EngineState:  # fmt: skip
    """``adapters``: the names of the LoRA adapters it holds, one letter each."""
    return EngineState(index, healthy, 0, 0, 0.0, in_flight, num_outstanding_tokens=outstanding,
                       num_free_kv_tokens=free_kv, num_cached_prefix_tokens=cached, lora_adapters=frozenset(adapters),
                       max_loras=max_loras)  # fmt: skip


def _select(router: object, engines: Sequence[EngineState], prompt_len: int = PROMPT_LEN,
            lora_name: str | None = None) -> int:  # fmt: skip
    assert isinstance(router, LeastLoadedRouter | KVAwareRouter | PrefixAwareRouter | LoRAAwareRouter
                      | RoundRobinRouter)  # fmt: skip
    return router.select(_request(prompt_len, lora_name), list(engines), [b"h" * 32] * (prompt_len // 16))


# ---------------------------------------------------------------- least_loaded, kv_aware


def test_least_loaded_picks_the_fewest_outstanding_tokens_among_healthy_engines() -> None:
    engines = [_engine(0, 900), _engine(1, 100, healthy=False), _engine(2, 300), _engine(3, 500)]
    assert _select(LeastLoadedRouter(), engines) == 2
    # Ties: fewest in flight, then lowest index.
    assert _select(LeastLoadedRouter(), [_engine(0, 5, in_flight=2), _engine(1, 5, in_flight=1)]) == 1
    assert _select(LeastLoadedRouter(), [_engine(0, 5), _engine(1, 5)]) == 0
    assert least_loaded([_engine(0, 9), _engine(1, 1)]) == 1


def test_kv_aware_picks_the_most_headroom_then_the_least_loaded() -> None:
    engines = [_engine(0, 10, free_kv=1000), _engine(1, 50, free_kv=4000), _engine(2, 0, free_kv=9000, healthy=False)]
    assert _select(KVAwareRouter(), engines) == 1
    assert _select(KVAwareRouter(), [_engine(0, 70, free_kv=500), _engine(1, 20, free_kv=500)]) == 1


# ---------------------------------------------------------------- prefix_aware


def test_prefix_aware_follows_the_longest_cached_prefix() -> None:
    engines = [_engine(0, 100, cached=16), _engine(1, 400, cached=48), _engine(2, 0, cached=32)]
    assert _select(PrefixAwareRouter(), engines) == 1
    # Equal matches: the less loaded of them.
    assert _select(PrefixAwareRouter(), [_engine(0, 300, cached=48), _engine(1, 200, cached=48), _engine(2)]) == 1


def test_prefix_aware_ignores_a_dead_engines_cache() -> None:
    engines = [_engine(0, 100, cached=64, healthy=False), _engine(1, 50), _engine(2, 10)]
    assert _select(PrefixAwareRouter(), engines) == 2


def test_prefix_aware_without_enough_of_the_prompt_cached_goes_to_the_least_loaded() -> None:
    engines = [_engine(0, 1000, cached=16), _engine(1, 10)]
    assert _select(PrefixAwareRouter(), engines) == 1  # 16 of 64 tokens < cache_threshold 0.5
    assert _select(PrefixAwareRouter(RoutersOptions(cache_threshold=0.25)), engines) == 0
    assert _select(PrefixAwareRouter(RoutersOptions(cache_threshold=0.0)), [_engine(0, 9), _engine(1, 1)]) == 1


def test_prefix_aware_falls_back_to_least_loaded_when_the_loads_are_imbalanced() -> None:
    options = RoutersOptions(balance_abs_threshold=1000, balance_rel_threshold=2.0)
    router = PrefixAwareRouter(options)
    # Gap 1500 > 1000 and ratio 4 > 2: imbalanced, so the cache does not matter.
    assert _select(router, [_engine(0, 2000, cached=64), _engine(1, 500)]) == 1
    # Gap 900 <= 1000: balanced, the cache wins despite the load.
    assert _select(router, [_engine(0, 1400, cached=64), _engine(1, 500)]) == 0
    # Gap 3000 > 1000 but ratio 1.6 <= 2: both limits must be passed (SGLang's rule).
    assert _select(router, [_engine(0, 8000, cached=64), _engine(1, 5000)]) == 0
    # A dead engine's load does not count.
    assert _select(router, [_engine(0, 2000, cached=64), _engine(1, 0, healthy=False), _engine(2, 1500)]) == 0


def test_imbalance_is_both_limits() -> None:
    engines = [_engine(0, 100), _engine(1, 0)]
    assert is_imbalanced(engines, 99, 1.5)
    assert not is_imbalanced(engines, 100, 1.5)  # the gap must exceed the threshold
    assert not is_imbalanced([_engine(0, 300), _engine(1, 200)], 50, 1.5)  # ratio 1.5 is not past 1.5


# ---------------------------------------------------------------- lora_aware


def test_lora_aware_sends_an_adapter_to_the_least_loaded_engine_holding_it() -> None:
    engines = [_engine(0, 100, adapters="b", max_loras=2), _engine(1, 900, adapters="ab", max_loras=2),
               _engine(2, 500, adapters="a", max_loras=2), _engine(3, 0, max_loras=2)]  # fmt: skip
    assert _select(LoRAAwareRouter(), engines, lora_name="a") == 2  # not 3, the least loaded, which lacks it
    assert _select(LoRAAwareRouter(), engines, lora_name="b") == 0
    # Holding it wins over a free slot, even where the adapter takes more than max_loras (its requests wait).
    assert _select(LoRAAwareRouter(), [_engine(0, 50, adapters="ab", max_loras=1), _engine(1)], lora_name="a") == 0


def test_lora_aware_without_a_holder_prefers_a_free_slot_then_the_least_loaded() -> None:
    engines = [_engine(0, 10, adapters="ab", max_loras=2), _engine(1, 300, adapters="b", max_loras=2),
               _engine(2, 200, adapters="bc", max_loras=2)]  # fmt: skip
    assert _select(LoRAAwareRouter(), engines, lora_name="d") == 1  # the only engine with a free slot
    full = [_engine(0, 300, adapters="a", max_loras=1), _engine(1, 200, adapters="b", max_loras=1)]
    assert _select(LoRAAwareRouter(), full, lora_name="d") == 1  # no free slot anywhere: the least loaded
    # Before an engine's first stats (max_loras 0), no slot counts as free.
    assert _select(LoRAAwareRouter(), [_engine(0, 300), _engine(1, 200)], lora_name="d") == 1


def test_lora_aware_sends_base_model_requests_to_the_least_loaded() -> None:
    engines = [_engine(0, 300, adapters="a", max_loras=2), _engine(1, 200, max_loras=2)]
    assert _select(LoRAAwareRouter(), engines) == 1


def test_lora_aware_ignores_a_dead_engine_that_holds_the_adapter() -> None:
    engines = [_engine(0, 0, adapters="a", max_loras=2, healthy=False), _engine(1, 90, adapters="b", max_loras=2),
               _engine(2, 50, adapters="bc", max_loras=2)]  # fmt: skip
    assert _select(LoRAAwareRouter(), engines, lora_name="a") == 1


def test_lora_aware_falls_back_to_least_loaded_when_the_loads_are_imbalanced() -> None:
    router = LoRAAwareRouter(RoutersOptions(balance_abs_threshold=1000, balance_rel_threshold=2.0))
    # Gap 1500 > 1000 and ratio 4 > 2: imbalanced, so the adapter does not matter.
    assert _select(router, [_engine(0, 2000, adapters="a", max_loras=1), _engine(1, 500, max_loras=1)],
                   lora_name="a") == 1  # fmt: skip
    # Gap 900 <= 1000: balanced, the adapter wins despite the load.
    assert _select(router, [_engine(0, 1400, adapters="a", max_loras=1), _engine(1, 500, max_loras=1)],
                   lora_name="a") == 0  # fmt: skip
    # The free-slot preference gives way too: engine 0 has the slot, engine 1 the lighter load.
    assert _select(router, [_engine(0, 2000, max_loras=1), _engine(1, 500, adapters="b", max_loras=1)],
                   lora_name="a") == 1  # fmt: skip


def test_lora_aware_keeps_a_burst_for_one_adapter_on_one_engine() -> None:
    """What the front end's estimate gives the router: each request sent counts as held (and as load) on
    its engine before the engine reports it, so a burst of two adapters over two idle engines with one slot
    each splits by adapter instead of loading both adapters on both engines."""
    router = LoRAAwareRouter()
    engines = [_engine(0, max_loras=1), _engine(1, max_loras=1)]
    placed: dict[str, set[int]] = {"a": set(), "b": set()}
    for lora_name in "abbaabab":
        index = _select(router, engines, lora_name=lora_name)
        placed[lora_name].add(index)
        sent = engines[index]  # as EngineClient.state() shows it after the request went out
        engines[index] = _engine(index, sent.num_outstanding_tokens + PROMPT_LEN + 16, in_flight=sent.num_in_flight + 1,
                                 adapters="".join(sent.lora_adapters | {lora_name}), max_loras=1)  # fmt: skip
    assert placed == {"a": {0}, "b": {1}}


@pytest.mark.parametrize(
    "router", [LeastLoadedRouter(), KVAwareRouter(), PrefixAwareRouter(), LoRAAwareRouter(), RoundRobinRouter()]
)
def test_the_routers_pass_the_conformance_check(router: object) -> None:
    check_router(router)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the plugin


@pytest.mark.parametrize(
    ("name", "cls"),
    [("least_loaded", LeastLoadedRouter), ("least-loaded", LeastLoadedRouter), ("kv_aware", KVAwareRouter),
     ("prefix_aware", PrefixAwareRouter), ("prefix-aware", PrefixAwareRouter), ("cache_aware", PrefixAwareRouter),
     ("lora_aware", LoRAAwareRouter), ("lora-aware", LoRAAwareRouter), ("lora_affinity", LoRAAwareRouter),
     ("round_robin", RoundRobinRouter), ("round-robin", RoundRobinRouter)],
)  # fmt: skip
def test_routers_load_through_the_entry_point_by_either_spelling(name: str, cls: type) -> None:
    plugins = load_plugins()
    router = plugins.create(Slot.ROUTER, name)
    assert type(router) is cls
    if cls is not RoundRobinRouter:
        assert plugins.registry.get(Slot.ROUTER, name).plugin == "routers"


def test_options_come_from_the_plugins_routers_table() -> None:
    plugins = load_plugins()
    plugins.configure({"routers": {"balance_abs_threshold": 10, "balance_rel_threshold": 3.0}})
    router = plugins.create(Slot.ROUTER, "prefix_aware")
    assert isinstance(router, PrefixAwareRouter)
    assert (router.options.balance_abs_threshold, router.options.balance_rel_threshold) == (10, 3.0)
    assert router.options.cache_threshold == 0.5
    with pytest.raises(PluginError, match=r"unknown option 'balance_threshold'; allowed: balance_abs_threshold"):
        plugins.configure({"routers": {"balance_threshold": 1}})
    with pytest.raises(PluginError, match=r"invalid option balance_rel_threshold"):
        plugins.configure({"routers": {"balance_rel_threshold": 0.5}})
