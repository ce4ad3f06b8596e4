"""ZmqTransport: frames both ways between one bound engine endpoint and several front-end connections."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenmill.errors import TokenmillError
from tokenmill.plugin_manager import Slot, load_plugins
from tokenmill.transport.base import EngineEndpoint, FrontendConnection
from tokenmill.transport.zmq_transport import ZmqTransport

_TIMEOUT_S = 5.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(params=["ipc", "tcp"])
def address(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "ipc":
        yield f"ipc://{tmp_path / 'engine.sock'}"
    else:
        yield f"tcp://127.0.0.1:{free_port()}"


async def _receive_all(endpoint: EngineEndpoint, count: int) -> list[tuple[bytes, bytes]]:
    """``count`` (peer, frame) pairs from the endpoint, polled off the event loop as the engine loop would."""
    received: list[tuple[bytes, bytes]] = []
    deadline = time.monotonic() + _TIMEOUT_S
    while len(received) < count:
        assert time.monotonic() < deadline, f"received {len(received)} of {count} frames"
        if await asyncio.to_thread(endpoint.poll, 100):
            while (item := endpoint.recv()) is not None:
                received.append(item)
    return received


async def _hello(endpoint: EngineEndpoint, connections: list[FrontendConnection]) -> dict[bytes, bytes]:
    """Each connection says its name; returns name -> the peer id the endpoint saw it under."""
    for number, connection in enumerate(connections):
        connection.send(b"peer-%d" % number)
    return {frame: peer for peer, frame in await _receive_all(endpoint, len(connections))}


@contextlib.contextmanager
def _serving(address: str, num_peers: int) -> Iterator[tuple[EngineEndpoint, list[FrontendConnection]]]:
    """An endpoint bound at ``address`` and ``num_peers`` connections to it, all closed afterwards."""
    transport = ZmqTransport()
    endpoint = transport.bind(address)
    connections = [transport.connect(address) for _ in range(num_peers)]
    try:
        yield endpoint, connections
    finally:
        for connection in connections:
            connection.close()  # closing twice is harmless
        endpoint.close()


def test_round_trip_both_ways_with_several_peers(address: str) -> None:
    async def run() -> None:
        with _serving(address, 3) as (endpoint, connections):
            peers = await _hello(endpoint, connections)
            assert sorted(peers) == [b"peer-0", b"peer-1", b"peer-2"]
            assert len(set(peers.values())) == 3  # every connection is its own peer
            for name, peer in peers.items():
                endpoint.send(peer, b"to " + name)
                endpoint.send(peer, b"again to " + name)
            for number, connection in enumerate(connections):
                assert await asyncio.wait_for(connection.poll(_TIMEOUT_S), _TIMEOUT_S + 1)
                assert await asyncio.wait_for(connection.recv(), _TIMEOUT_S) == b"to peer-%d" % number
                assert await asyncio.wait_for(connection.recv(), _TIMEOUT_S) == b"again to peer-%d" % number
            # Frames keep their bytes exactly, whatever they contain, and arrive in order.
            payload = bytes(range(256)) * 1000
            connections[1].send(payload)
            connections[1].send(b"")
            assert await _receive_all(endpoint, 2) == [(peers[b"peer-1"], payload), (peers[b"peer-1"], b"")]

    asyncio.run(run())


def test_nothing_pending(address: str) -> None:
    async def run() -> None:
        with _serving(address, 1) as (endpoint, [connection]):
            assert endpoint.poll(0) is False
            assert endpoint.recv() is None
            assert await connection.poll(0.05) is False

    asyncio.run(run())


def test_a_frame_to_a_gone_peer_is_dropped(address: str) -> None:
    async def run() -> None:
        with _serving(address, 2) as (endpoint, [gone, staying]):
            peers = await _hello(endpoint, [gone, staying])
            gone.close()
            await asyncio.sleep(0.1)  # let the endpoint see the disconnect
            started = time.monotonic()
            for _ in range(1000):
                endpoint.send(peers[b"peer-0"], b"x" * 1000)  # neither raises nor blocks
            endpoint.send(b"never-connected", b"x")
            assert time.monotonic() - started < 1.0
            endpoint.send(peers[b"peer-1"], b"still here")
            assert await asyncio.wait_for(staying.recv(), _TIMEOUT_S) == b"still here"

    asyncio.run(run())


def test_an_address_in_use_names_it() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    transport = ZmqTransport()
    endpoint = transport.bind(address)
    try:
        with pytest.raises(TokenmillError, match="127.0.0.1"):
            transport.bind(address)
    finally:
        endpoint.close()


def test_registered_as_zmq() -> None:
    transport = load_plugins(autoload=False).create(Slot.TRANSPORT, "zmq")
    assert isinstance(transport, ZmqTransport)
    assert transport.name == "zmq"
