"""``check_router`` and ``check_transport``: the front end's slots (no torch needed)."""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
import subprocess
import sys
import time

from tokenmill.lora.request import LoRARequest
from tokenmill.messages import EngineCoreRequest
from tokenmill.routing import EngineState, Router
from tokenmill.sampling_params import SamplingParams
from tokenmill.testing.conformance._util import calling, conformance_check, fail, instantiate
from tokenmill.transport.base import EngineEndpoint, FrontendConnection, Transport

_LORA_NAMES = ["a", "b", "c"]


@conformance_check
def check_router(
    router: type[Router] | Router, *, max_engines: int = 4, torch_free: bool = True, seed: int = 0
) -> None:
    """Check a router against the ``Router`` contract.

    For 1 to ``max_engines`` engines and every pattern of which are healthy (at least one), with random
    loads, KV headroom, cached prefixes and LoRA adapters held, ``select`` returns the ``index`` of a healthy
    engine, every time, for requests with and without a prefix (``prefix_hashes`` are given when
    ``needs_prefix_hashes``) and with and without an adapter, within a second. With
    ``torch_free``, the router's module is imported in a fresh interpreter, which must not import torch:
    routers run in the API front end.

    :param router: the class (built with no arguments) or an instance (a plugin's, with its options).
    :raises AssertionError: naming the engines and the choice.
    """
    candidate = instantiate(router)
    name = type(candidate).__name__
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=4)
    counter = itertools.count()
    for num_engines in range(1, max_engines + 1):
        for health in itertools.product((True, False), repeat=num_engines):
            if not any(health):
                continue  # the caller never asks without a healthy engine
            engines = [
                EngineState(
                    index=i,
                    is_healthy=healthy,
                    num_running=rng.randrange(64),
                    num_waiting=rng.randrange(8),
                    kv_cache_usage=rng.random(),
                    num_in_flight=rng.randrange(64),
                    num_outstanding_tokens=rng.randrange(10_000),
                    num_free_kv_tokens=rng.randrange(10_000),
                    num_cached_prefix_tokens=rng.choice((0, 16, 32)),
                    lora_adapters=frozenset(rng.sample(_LORA_NAMES, rng.randrange(3))),
                    max_loras=rng.choice((0, 1, 2)),
                )  # fmt: skip
                for i, healthy in enumerate(health)
            ]
            healthy_indices = {engine.index for engine in engines if engine.is_healthy}
            # The same long prompt twice (a prefix-aware router may reuse it), then with an adapter, twice.
            for prompt_len, lora_name in ((3, None), (40, None), (40, None), (40, "a"), (40, "a"), (40, "c")):
                lora = LoRARequest(lora_name, 1 + _LORA_NAMES.index(lora_name), "/unused") if lora_name else None
                request = EngineCoreRequest(f"req-{next(counter)}", list(range(prompt_len)), params, [2], 0.0,
                                            lora_request=lora)  # fmt: skip
                prefix_hashes = (
                    [bytes([b]) * 8 for b in range(prompt_len // 16)] if candidate.needs_prefix_hashes else []
                )
                started = time.monotonic()
                with calling(f"{name}.select with engines {list(health)} (healthy or not)"):
                    choice = candidate.select(request, list(engines), prefix_hashes)
                if time.monotonic() - started > 1.0:
                    fail(f"{name}.select took {time.monotonic() - started:.2f} s; it runs in the event loop and "
                         "must not block")  # fmt: skip
                if not isinstance(choice, int) or isinstance(choice, bool) or choice not in healthy_indices:
                    fail(f"{name}.select returned {choice!r} for engines whose health is {list(health)}; it must "
                         f"return the index of a healthy one: {sorted(healthy_indices)}")  # fmt: skip
    if torch_free:
        _check_torch_free(type(candidate))


def _check_torch_free(router_class: type[Router]) -> None:
    module = router_class.__module__
    code = f"import importlib, sys; importlib.import_module({module!r}); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        fail(f"importing {module} (where {router_class.__name__} lives) failed in a fresh interpreter: "
             f"{result.stderr.strip().splitlines()[-1:]}")  # fmt: skip
    if result.stdout.strip() != "False":
        fail(f"importing {module} imports torch; a router runs in the API front end, which never imports torch "
             "(import it inside the functions that need it, or move them to another module)")  # fmt: skip


def free_tcp_address() -> str:
    """A ``tcp://`` address on a loopback port that is free now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


@conformance_check
def check_transport(
    transport: type[Transport] | Transport, *, address: str | None = None, timeout_s: float = 5.0
) -> None:
    """Check a transport by sending frames both ways between one bound endpoint and two front ends.

    Frames arrive whole, in order and at the right peer, from a byte to 1 MiB; ``poll`` and ``recv`` report
    nothing pending when nothing was sent; a frame for a peer that has gone is dropped without error; every
    side closes.

    :param transport: the class (built with no arguments) or an instance.
    :param address: where to bind; default a free ``tcp://`` loopback port.
    :raises AssertionError: naming the direction and the frame.
    """
    candidate = instantiate(transport)
    asyncio.run(_exercise_transport(candidate, address or free_tcp_address(), timeout_s))


async def _exercise_transport(transport: Transport, address: str, timeout_s: float) -> None:
    name = type(transport).__name__
    endpoint = transport.bind(address)
    connections: list[FrontendConnection] = []
    try:
        if endpoint.poll(0) or endpoint.recv() is not None:
            fail(f"{name}: a new endpoint reports a frame pending before anything was sent")
        frames = [b"\x00", bytes(range(256)), b"x" * (1 << 20), b"last"]
        connections = [transport.connect(address), transport.connect(address)]
        peers: list[bytes] = []
        for number, connection in enumerate(connections):
            for frame in frames:
                connection.send(frame + bytes([number]))
            received = [await _engine_recv(endpoint, timeout_s, name) for _ in frames]
            if [frame for _, frame in received] != [frame + bytes([number]) for frame in frames]:
                fail(f"{name}: front end {number}'s frames reached the engine changed or out of order")
            if len({peer for peer, _ in received}) != 1:
                fail(f"{name}: frames from one front end arrived with different peer ids")
            peers.append(received[0][0])
        if peers[0] == peers[1]:
            fail(f"{name}: two front ends got the same peer id")
        for number in (1, 0):
            for frame in frames:
                endpoint.send(peers[number], frame + b"reply" + bytes([number]))
        for number, connection in enumerate(connections):
            for frame in frames:
                if not await connection.poll(timeout_s):
                    fail(f"{name}: front end {number} got no reply frame within {timeout_s} s")
                got = await connection.recv()
                if got != frame + b"reply" + bytes([number]):
                    fail(f"{name}: front end {number} received {got[:20]!r}..., not its own reply, in order")
        if await connections[0].poll(0.05):
            fail(f"{name}: a front end reports a frame pending after it received every reply")
        endpoint.send(b"no-such-peer", b"dropped")  # must not raise
    finally:
        for connection in connections:
            connection.close()
        endpoint.close()


async def _engine_recv(endpoint: EngineEndpoint, timeout_s: float, name: str) -> tuple[bytes, bytes]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # The engine side blocks; in its own thread, as in the engine process.
        if await asyncio.to_thread(endpoint.poll, 50):
            received = endpoint.recv()
            if received is None:
                fail(f"{name}: poll reported a frame but recv returned None")
            return received
    fail(f"{name}: the engine received nothing within {timeout_s} s")
