"""Routers and how the front end's RoutedEngineGroup uses them; the disaggregated group, which has none.

Real ``EngineClient`` objects talk to in-memory engines through a fake transport: each fake engine answers
``Hello`` with a ``Ready`` and records the requests it receives, so routing is checked end to end in the
front end without starting engine processes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar

import pytest

from tokenmill.engine_client import DisaggregatedGroup, EngineClient, EngineDeadError, RoutedEngineGroup
from tokenmill.hookspecs import Register, hookimpl
from tokenmill.kv_cache.block_hash import block_hashes
from tokenmill.lora.request import LoRARequest
from tokenmill.messages import (
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStatsMessage,
    Hello,
    Ready,
)
from tokenmill.plugin_manager import Slot, load_plugins
from tokenmill.routing import EngineState, RoundRobinRouter, Router
from tokenmill.sampling_params import SamplingParams
from tokenmill.transport.base import EngineEndpoint, FrontendConnection, Transport
from tokenmill.transport.serde import decode_to_engine, encode

BLOCK_SIZE = 4
HASH_SALT = "model-x:float32"


class _FakeEngine(FrontendConnection):
    """A connection whose far end is an engine that answers the handshake and keeps the requests it gets."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.request_ids: list[str] = []
        self.requests: list[EngineCoreRequest] = []
        self.num_hellos = 0

    def send(self, frame: bytes) -> None:
        message = decode_to_engine(frame)
        if isinstance(message, Hello):
            self.num_hellos += 1
            ready = Ready(PROTOCOL_VERSION, "model-x", 128, 8, block_size=BLOCK_SIZE, hash_salt=HASH_SALT)
            self.inbox.put_nowait(encode(ready))
        elif isinstance(message, EngineCoreRequest):
            self.request_ids.append(message.request_id)
            self.requests.append(message)

    async def recv(self) -> bytes:
        return await self.inbox.get()

    async def poll(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.inbox.empty() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        return not self.inbox.empty()

    def close(self) -> None:
        pass


class _FakeTransport(Transport):
    name: ClassVar[str] = "fake"

    def __init__(self) -> None:
        self.engines: dict[str, _FakeEngine] = {}

    def bind(self, address: str) -> EngineEndpoint:
        raise NotImplementedError

    def connect(self, address: str) -> FrontendConnection:
        self.engines[address] = _FakeEngine()
        return self.engines[address]


def _request(
    request_id: str, prompt_token_ids: Sequence[int] = (1, 2, 3), cache_salt: str | None = None
) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(prompt_token_ids), SamplingParams(), [0], 0.0, cache_salt=cache_salt)


def _with_group(
    router: Router,
    body: Callable[[RoutedEngineGroup, _FakeTransport], Awaitable[None]],
    num_engines: int = 3,
    **labels: str,
) -> None:
    """Run ``body`` with a started group of ``num_engines`` fake engines routed by ``router``."""

    async def run() -> None:
        transport = _FakeTransport()
        clients = [EngineClient(f"fake://{index}", transport, index) for index in range(num_engines)]
        group = RoutedEngineGroup(clients, router, **labels)
        try:
            await asyncio.gather(*(client.start(timeout=5) for client in clients))
            await body(group, transport)
        finally:
            await group.close()

    asyncio.run(run())


def _received(transport: _FakeTransport) -> list[list[str]]:
    return [transport.engines[f"fake://{index}"].request_ids for index in range(len(transport.engines))]


class _RecordingRouter(Router):
    name: ClassVar[str] = "recording"
    needs_prefix_hashes: ClassVar[bool] = True

    def __init__(self) -> None:
        self.calls: list[tuple[list[EngineState], list[bytes]]] = []

    def select(self, request: EngineCoreRequest, engines: list[EngineState], prefix_hashes: Sequence[bytes]) -> int:
        self.calls.append((engines, list(prefix_hashes)))
        return 0


class _FlakyRouter(Router):
    """Fails requests whose id starts with ``raise`` (ValueError) or ``index-N`` (returns N); else engine 0."""

    name: ClassVar[str] = "flaky"

    def select(self, request: EngineCoreRequest, engines: list[EngineState], prefix_hashes: Sequence[bytes]) -> int:
        if request.request_id.startswith("raise"):
            raise ValueError("boom")
        if request.request_id.startswith("index-"):
            return int(request.request_id.removeprefix("index-"))
        return 0


# ---------------------------------------------------------------- round robin


def test_round_robin_cycles_over_healthy_engines() -> None:
    router = RoundRobinRouter()
    engines = [EngineState(index, index != 1, 0, 0, 0.0, 0) for index in range(3)]
    assert [router.select(_request(str(i)), engines, ()) for i in range(5)] == [0, 2, 0, 2, 0]


def test_group_round_robin_skips_a_dead_engine() -> None:
    async def body(group: RoutedEngineGroup, transport: _FakeTransport) -> None:
        for number in range(3):
            group.add_request(_request(f"a{number}"))
        group.clients[1].is_dead = True
        for number in range(4):
            group.add_request(_request(f"b{number}"))
        assert _received(transport) == [["a0", "b1", "b3"], ["a1"], ["a2", "b0", "b2"]]

    _with_group(RoundRobinRouter(), body)


# ---------------------------------------------------------------- prefix hashes


def test_prefix_hashes_match_the_engines_block_hashes() -> None:
    router = _RecordingRouter()
    prompt = list(range(100, 111))  # two full blocks of 4 and a partial one

    async def body(group: RoutedEngineGroup, transport: _FakeTransport) -> None:
        group.add_request(_request("plain", prompt))
        group.add_request(_request("salted", prompt, cache_salt="tenant-a"))
        group.add_request(_request("short", prompt[:3]))

    _with_group(router, body)
    plain, salted, short = (hashes for _, hashes in router.calls)
    assert plain == block_hashes(prompt, BLOCK_SIZE, HASH_SALT, None)
    assert len(plain) == 2
    assert salted == block_hashes(prompt, BLOCK_SIZE, HASH_SALT, "tenant-a")
    assert salted != plain
    assert short == []
    states = router.calls[0][0]
    assert [state.index for state in states] == [0, 1, 2]
    assert all(state.is_healthy for state in states)


def test_no_prefix_hashes_unless_the_router_asks() -> None:
    class Blind(_RecordingRouter):
        needs_prefix_hashes: ClassVar[bool] = False

    router = Blind()

    async def body(group: RoutedEngineGroup, transport: _FakeTransport) -> None:
        group.add_request(_request("r", list(range(16))))

    _with_group(router, body)
    assert router.calls[0][1] == []


# ---------------------------------------------------------------- failures


async def _report(transport: _FakeTransport, index: int, stats: EngineStatsMessage) -> None:
    """Engine ``index`` sends ``stats`` (with no outputs), and the front end reads it."""
    transport.engines[f"fake://{index}"].inbox.put_nowait(encode(EngineCoreOutputs([], stats)))
    await asyncio.sleep(0.01)


def _stats(num_outstanding_tokens: int = 0, **fields: Any) -> EngineStatsMessage:
    return EngineStatsMessage(0, 0, 0.0, 0, 0, 0, 0, 0, num_outstanding_tokens=num_outstanding_tokens, **fields)


def test_a_raising_router_falls_back_to_least_loaded_and_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    async def body(group: RoutedEngineGroup, transport: _FakeTransport) -> None:
        await _report(transport, 0, _stats(500))
        await _report(transport, 1, _stats(100))
        await _report(transport, 2, _stats(300))
        group.add_request(_request("raise-1"))  # served by the least loaded engine: 1
        group.add_request(_request("ok"))
        assert _received(transport) == [["ok"], ["raise-1"], []]
        assert group.num_in_flight == 2
        assert group.num_router_fallbacks == {"error": 1, "invalid_choice": 0}

    with caplog.at_level("ERROR", logger="tokenmill.engine_client"):
        _with_group(_FlakyRouter(), body, router_name="flaky", plugin_name="my-routers")
    assert "router 'flaky' (plugin 'my-routers') failed for request raise-1 (ValueError: boom); routing it with " \
        "least_loaded" in caplog.text  # fmt: skip


@pytest.mark.parametrize("index", [3, -1])
def test_an_index_out_of_range_falls_back_and_is_counted(index: int) -> None:
    async def body(group: RoutedEngineGroup, transport: _FakeTransport) -> None:
        await _report(transport, 0, _stats(50))
        group.add_request(_request(f"index-{index}"))
        assert _received(transport) == [[], [f"index-{index}"], []]  # 1 and 2 are idle; ties go to the lower
        assert group.num_router_fallbacks == {"error": 0, "invalid_choice": 1}

    _with_group(_FlakyRouter(), body, router_name="flaky", plugin_name="my-routers")


def test_a_dead_engine_chosen_falls_back_to_a_healthy_one() -> None:
    async def body(group: RoutedEngineGroup, transport: _FakeTransport) -> None:
        group.clients[2].is_dead = True
        await _report(transport, 0, _stats(50))
        group.add_request(_request("index-2"))
        group.add_request(_request("index-1"))
        assert _received(transport) == [[], ["index-2", "index-1"], []]
        assert group.num_router_fallbacks["invalid_choice"] == 1

    _with_group(_FlakyRouter(), body)


class _RouterPlugin:
    @hookimpl
    def tokenmill_register_routers(self, register: Register) -> None:
        register("flaky", "tests.core.test_routing:_FlakyRouter")


def test_a_router_from_a_plugin_is_named_by_its_plugin(caplog: pytest.LogCaptureFixture) -> None:
    """What ``tokenmill serve`` does: build the router through the plugin system, label it by its plugin."""
    plugins = load_plugins(autoload=False, extra_plugins=[("my-routers", _RouterPlugin())])
    router = plugins.create(Slot.ROUTER, "flaky")
    plugin_name = plugins.registry.get(Slot.ROUTER, "flaky").plugin

    async def body(group: RoutedEngineGroup, transport: _FakeTransport) -> None:
        group.add_request(_request("raise-2"))
        assert group.router_name == "flaky"

    with caplog.at_level("ERROR", logger="tokenmill.engine_client"):
        _with_group(router, body, router_name="flaky", plugin_name=plugin_name)
    assert "router 'flaky' (plugin 'my-routers') failed for request raise-2" in caplog.text


# ---------------------------------------------------------------- what routers see


def test_states_carry_the_engines_stats_plus_the_requests_sent_since() -> None:
    async def body(group: RoutedEngineGroup, transport: _FakeTransport) -> None:
        await _report(transport, 1, _stats(40, num_free_kv_blocks=100))
        state = group.clients[1].state()
        assert (state.num_outstanding_tokens, state.num_free_kv_tokens) == (40, 100 * BLOCK_SIZE)
        # Sent, not counted by the engine yet: 10 prompt tokens + max_tokens 16 (SamplingParams' default), n=2.
        request = EngineCoreRequest("r", list(range(10)), SamplingParams(n=2), [0], 0.0)
        group.clients[1].add_request(request)
        state = group.clients[1].state()
        assert state.num_outstanding_tokens == 40 + 10 + 2 * 16
        assert state.num_free_kv_tokens == 100 * BLOCK_SIZE - 42
        await _report(transport, 1, _stats(77, num_free_kv_blocks=90))  # the engine counts it now
        state = group.clients[1].state()
        assert (state.num_outstanding_tokens, state.num_free_kv_tokens) == (77, 90 * BLOCK_SIZE)

    _with_group(RoundRobinRouter(), body)


def _lora_request(request_id: str, lora_name: str) -> EngineCoreRequest:
    lora = LoRARequest(lora_name, 1 + ord(lora_name[0]), f"/adapters/{lora_name}")
    return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(), [0], 0.0, lora_request=lora)


def test_states_name_the_adapters_an_engine_holds_from_its_stats_and_the_requests_in_flight() -> None:
    async def body(group: RoutedEngineGroup, transport: _FakeTransport) -> None:
        client = group.clients[0]
        assert (client.state().lora_adapters, client.state().max_loras) == (frozenset(), 0)
        await _report(transport, 0, _stats(running_lora_adapters=["a"], waiting_lora_adapters=["b"], max_loras=2))
        assert (client.state().lora_adapters, client.state().max_loras) == ({"a", "b"}, 2)
        # Requests sent count at once, and until they end, whatever the engine reports meanwhile (a report
        # may have left before the request arrived).
        client.add_request(_lora_request("c1", "c"))
        client.add_request(_lora_request("c2", "c"))
        client.add_request(_lora_request("d1", "d"))
        client.add_request(_request("base"))
        assert client.state().lora_adapters == {"a", "b", "c", "d"}
        await _report(transport, 0, _stats(max_loras=2))
        assert client.state().lora_adapters == {"c", "d"}
        client.release("c1")
        client.abort(["d1"])
        assert client.state().lora_adapters == {"c"}
        client.abort(["c2"], completions_only=True)  # one completion of it: the request still runs
        assert client.state().lora_adapters == {"c"}
        client.release("c2")
        client.release("base")
        assert client.state().lora_adapters == frozenset()
        # An engine that dies fails its requests: it holds their adapters no more.
        client.add_request(_lora_request("c3", "c"))
        client.fail_requests("drained")
        assert client.state().lora_adapters == frozenset()

    _with_group(RoundRobinRouter(), body, num_engines=1)


def test_lora_aware_keeps_each_adapter_of_a_burst_on_one_engine() -> None:
    """Through the group, before any engine reports the requests: the front end's own count is what keeps
    the burst together."""
    router = load_plugins().create(Slot.ROUTER, "lora_aware")

    async def body(group: RoutedEngineGroup, transport: _FakeTransport) -> None:
        for index in range(2):
            await _report(transport, index, _stats(max_loras=1))
        for number, lora_name in enumerate("abbaabba"):
            group.add_request(_lora_request(f"{lora_name}{number}", lora_name))
        group.add_request(_request("base"))  # the least loaded: equal loads, so the lower index
        assert _received(transport) == [["a0", "a3", "a4", "a7", "base"], ["b1", "b2", "b5", "b6"]]

    _with_group(router, body, num_engines=2)


def _summary(
    seq: int, added: Sequence[bytes] = (), removed: Sequence[bytes] = (), reset: bool = False
) -> EngineStatsMessage:
    return _stats(prefix_cache_seq=seq, prefix_cache_reset=reset, prefix_cache_added=b"".join(h[:8] for h in added),
                  prefix_cache_removed=b"".join(h[:8] for h in removed))  # fmt: skip


def test_states_say_how_much_of_the_prompt_each_engine_caches() -> None:
    router = _RecordingRouter()
    prompt = list(range(100, 113))  # three full blocks of 4
    hashes = block_hashes(prompt, BLOCK_SIZE, HASH_SALT, None)

    async def body(group: RoutedEngineGroup, transport: _FakeTransport) -> None:
        await _report(transport, 1, _summary(1, hashes[:2], reset=True))
        await _report(transport, 2, _summary(1, hashes, reset=True))
        await _report(transport, 2, _summary(2, removed=hashes[1:2]))  # evicted: the chain breaks after block 0
        group.add_request(_request("first", prompt))
        cached = [state.num_cached_prefix_tokens for state in router.calls[0][0]]
        assert cached == [0, 2 * BLOCK_SIZE, 1 * BLOCK_SIZE]
        # The request went to engine 0 (the recording router's pick): its prefix counts as held there now,
        # before engine 0 reports it, so the next request with that prefix can follow it.
        group.add_request(_request("second", prompt[:8] + [7, 7, 7, 7]))
        cached = [state.num_cached_prefix_tokens for state in router.calls[1][0]]
        assert cached == [2 * BLOCK_SIZE, 2 * BLOCK_SIZE, 1 * BLOCK_SIZE]

    _with_group(router, body)


def test_a_missed_stats_message_asks_the_engine_for_a_snapshot() -> None:
    hashes = block_hashes(list(range(8)), BLOCK_SIZE, HASH_SALT, None)

    async def body(group: RoutedEngineGroup, transport: _FakeTransport) -> None:
        engine = transport.engines["fake://0"]
        num_hellos = engine.num_hellos
        await _report(transport, 0, _summary(1, hashes[:1], reset=True))
        await _report(transport, 0, _summary(3, hashes[1:]))  # message 2 was lost
        assert engine.num_hellos == num_hellos + 1
        summary = group.clients[0].prefix_cache
        assert not summary.is_synced and summary.keys == {hashes[0][:8]}  # the delta after the gap is not applied
        await _report(transport, 0, _summary(4, hashes[1:]))  # sent before the engine saw the Hello: ignored
        assert summary.keys == {hashes[0][:8]}
        await _report(transport, 0, _summary(5, hashes, reset=True))
        assert summary.is_synced and summary.keys == {h[:8] for h in hashes}

    _with_group(RoundRobinRouter(), body, num_engines=1)


def test_disaggregated_requests_go_to_prefill_then_to_decode_with_the_kv_transfer_params() -> None:
    async def run() -> None:
        transport = _FakeTransport()
        prefill, decode = (EngineClient(f"fake://{index}", transport, index) for index in range(2))
        group = DisaggregatedGroup(prefill, decode)
        await asyncio.gather(prefill.start(timeout=5), decode.start(timeout=5))
        prefill_engine, decode_engine = transport.engines["fake://0"], transport.engines["fake://1"]
        request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0.7), [0], 0.0)
        stream = group.add_request(request)
        await asyncio.sleep(0.05)
        (sent,) = prefill_engine.requests
        assert sent.params.max_tokens == 1 and sent.kv_transfer_params == {"do_remote_decode": True}
        assert decode_engine.requests == [] and group.num_in_flight == 1  # decode waits for the prefill
        finished = EngineCoreOutput("r", [7], finish_reason="length", request_finished=True)
        prefill_engine.inbox.put_nowait(
            encode(EngineCoreOutputs([finished], EngineStatsMessage(0, 0, 0.0, 0, 0, 0, 0, 0)))
        )
        await asyncio.sleep(0.05)
        (forwarded,) = decode_engine.requests
        assert forwarded.params == request.params and forwarded.kv_transfer_params == {"do_remote_prefill": True}
        assert stream.client is decode and not prefill.has_stream("r")

        async def broken(request: EngineCoreRequest) -> None:
            raise RuntimeError("boom")

        group._prefill_then_decode = broken  # type: ignore[method-assign]
        failed = group.add_request(_request("s"))
        item = await asyncio.wait_for(failed.queue.get(), 5)
        assert isinstance(item, EngineDeadError) and "boom" in str(item)  # never a client left waiting
        await group.close()

    asyncio.run(run())
