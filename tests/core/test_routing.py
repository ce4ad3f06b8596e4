"""Routers and how the front end's EngineGroup uses them.

Real ``EngineClient`` objects talk to in-memory engines through a fake transport: each fake engine answers
``Hello`` with a ``Ready`` and records the requests it receives, so routing is checked end to end in the
front end without starting engine processes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import ClassVar

import pytest

from tokenmill.engine_client import DisaggregatedGroup, EngineClient, EngineDeadError, EngineGroup, RouterError
from tokenmill.hookspecs import Register, hookimpl
from tokenmill.kv_cache.block_hash import block_hashes
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

    def send(self, frame: bytes) -> None:
        message = decode_to_engine(frame)
        if isinstance(message, Hello):
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
    router: Router, body: Callable[[EngineGroup, _FakeTransport], Awaitable[None]], num_engines: int = 3, **labels: str
) -> None:
    """Run ``body`` with a started group of ``num_engines`` fake engines routed by ``router``."""

    async def run() -> None:
        transport = _FakeTransport()
        clients = [EngineClient(f"fake://{index}", transport, index) for index in range(num_engines)]
        group = EngineGroup(clients, router, **labels)
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
    async def body(group: EngineGroup, transport: _FakeTransport) -> None:
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

    async def body(group: EngineGroup, transport: _FakeTransport) -> None:
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

    async def body(group: EngineGroup, transport: _FakeTransport) -> None:
        group.add_request(_request("r", list(range(16))))

    _with_group(router, body)
    assert router.calls[0][1] == []


# ---------------------------------------------------------------- failures


def test_a_raising_router_fails_only_that_request() -> None:
    async def body(group: EngineGroup, transport: _FakeTransport) -> None:
        with pytest.raises(RouterError) as info:
            group.add_request(_request("raise-1"))
        assert str(info.value) == "router 'flaky' (plugin 'my-routers') failed: ValueError: boom"
        group.add_request(_request("ok"))
        assert _received(transport) == [["ok"], [], []]
        assert group.num_in_flight == 1

    _with_group(_FlakyRouter(), body, router_name="flaky", plugin_name="my-routers")


@pytest.mark.parametrize("index", [3, -1])
def test_an_index_out_of_range_is_a_router_error(index: int) -> None:
    async def body(group: EngineGroup, transport: _FakeTransport) -> None:
        with pytest.raises(RouterError, match=rf"router 'flaky' \(plugin 'my-routers'\) failed: returned {index}"):
            group.add_request(_request(f"index-{index}"))
        assert _received(transport) == [[], [], []]

    _with_group(_FlakyRouter(), body, router_name="flaky", plugin_name="my-routers")


def test_a_dead_engine_is_a_router_error() -> None:
    async def body(group: EngineGroup, transport: _FakeTransport) -> None:
        group.clients[2].is_dead = True
        with pytest.raises(RouterError, match=r"returned 2, not a healthy engine \(healthy: \[0, 1\]\)"):
            group.add_request(_request("index-2"))
        group.add_request(_request("index-1"))
        assert _received(transport) == [[], ["index-1"], []]

    _with_group(_FlakyRouter(), body)


class _RouterPlugin:
    @hookimpl
    def tokenmill_register_routers(self, register: Register) -> None:
        register("flaky", "tests.core.test_routing:_FlakyRouter")


def test_a_router_from_a_plugin_is_named_by_its_plugin() -> None:
    """What ``tokenmill serve`` does: build the router through the plugin system, label it by its plugin."""
    plugins = load_plugins(autoload=False, extra_plugins=[("my-routers", _RouterPlugin())])
    router = plugins.create(Slot.ROUTER, "flaky")
    plugin_name = plugins.registry.get(Slot.ROUTER, "flaky").plugin

    async def body(group: EngineGroup, transport: _FakeTransport) -> None:
        with pytest.raises(RouterError, match=r"^router 'flaky' \(plugin 'my-routers'\) failed: ValueError: boom$"):
            group.add_request(_request("raise-2"))

    _with_group(router, body, router_name="flaky", plugin_name=plugin_name)


def test_disaggregated_requests_go_to_prefill_then_to_decode_with_the_kv_transfer_params() -> None:
    async def run() -> None:
        transport = _FakeTransport()
        prefill, decode = (EngineClient(f"fake://{index}", transport, index) for index in range(2))
        group = DisaggregatedGroup(prefill, decode, RoundRobinRouter())
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
