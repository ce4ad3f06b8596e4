"""The built-in transport: ZeroMQ, ``ipc://`` on one host and ``tcp://`` across hosts.

The engine binds a ROUTER socket, which prefixes every frame with the sending
peer's identity and drops frames addressed to a peer it no longer knows; each
front end connects a DEALER socket driven by ``zmq.asyncio``. Both use
``LINGER 0``, so closing never waits for frames a dead peer will not take.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import zmq
import zmq.asyncio

from tokenmill.errors import TokenmillError
from tokenmill.transport.base import EngineEndpoint, FrontendConnection, Transport

logger = logging.getLogger(__name__)


class ZmqEngineEndpoint(EngineEndpoint):
    """A bound ROUTER socket with its own (synchronous) context."""

    def __init__(self, address: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(address)
        except zmq.ZMQError as exc:
            self.close()
            raise TokenmillError(f"cannot serve {address!r}: {exc}") from None

    def poll(self, timeout_ms: int) -> bool:
        return bool(self._socket.poll(timeout_ms))

    def recv(self) -> tuple[bytes, bytes] | None:
        while True:
            try:
                parts = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
            if len(parts) == 2:
                return parts[0], parts[1]
            # A front end speaking tokenmill sends one frame per message: anything else is not ours.
            logger.warning("dropping a message of %d parts from peer %r", len(parts), parts[0])

    def send(self, peer: bytes, frame: bytes) -> None:
        # A ROUTER drops, rather than blocks on, frames for unknown peers or peers over their high-water mark.
        self._socket.send_multipart([peer, frame], zmq.NOBLOCK)

    def close(self) -> None:
        self._socket.close()
        self._context.term()


class ZmqFrontendConnection(FrontendConnection):
    """A DEALER socket on the process-wide ``zmq.asyncio`` context."""

    def __init__(self, address: str) -> None:
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.connect(address)
        except zmq.ZMQError as exc:
            self._socket.close()
            raise TokenmillError(f"cannot connect to {address!r}: {exc}") from None

    def send(self, frame: bytes) -> None:
        # zmq.asyncio queues the frame and returns a future we need not await.
        self._socket.send(frame)

    async def recv(self) -> bytes:
        frame = await self._socket.recv()
        assert isinstance(frame, bytes)
        return frame

    async def poll(self, timeout_s: float) -> bool:
        return bool(await self._socket.poll(timeout_s * 1000))

    def close(self) -> None:
        self._socket.close()


class ZmqTransport(Transport):
    """ZeroMQ ROUTER (engine) and DEALER (front end) sockets."""

    name: ClassVar[str] = "zmq"

    def bind(self, address: str) -> EngineEndpoint:
        return ZmqEngineEndpoint(address)

    def connect(self, address: str) -> FrontendConnection:
        return ZmqFrontendConnection(address)
