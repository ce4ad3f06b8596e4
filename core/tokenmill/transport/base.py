"""The transport interface: sockets and framing between the front end and engine processes.

Messages are encoded once by ``tokenmill.transport.serde`` (msgspec, never
pickle); a transport moves the encoded frames. An engine *binds* an address
and serves any number of front ends, each known by an opaque peer id; a front
end *connects* to one engine per address. Addresses are URLs whose scheme the
transport understands (``ipc://``, ``tcp://`` for ZeroMQ), so an engine on
another machine is a config line.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar


class EngineEndpoint(ABC):
    """The engine's side: one bound address, many peers. Used only from the engine loop's thread."""

    @abstractmethod
    def poll(self, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` (0: don't wait) for a frame; True when one can be received."""

    @abstractmethod
    def recv(self) -> tuple[bytes, bytes] | None:
        """The next ``(peer, frame)`` without waiting, or None when nothing is pending."""

    @abstractmethod
    def send(self, peer: bytes, frame: bytes) -> None:
        """Queue ``frame`` for ``peer`` without waiting; frames to a peer that has gone are dropped."""

    @abstractmethod
    def close(self) -> None:
        """Release the address. Called once, at engine shutdown."""


class FrontendConnection(ABC):
    """The front end's side: one connection to one engine, used from the front end's asyncio event loop."""

    @abstractmethod
    def send(self, frame: bytes) -> None:
        """Queue ``frame`` for the engine without waiting."""

    @abstractmethod
    async def recv(self) -> bytes:
        """The next frame from the engine, waiting as long as it takes."""

    @abstractmethod
    async def poll(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a frame; True when one can be received."""

    @abstractmethod
    def close(self) -> None:
        """Drop the connection; pending frames are discarded."""


class Transport(ABC):
    """Makes engine endpoints and front-end connections. Built once per process with no arguments
    (plus ``options=`` when its plugin declares options); the front end and its engines must use the same
    transport. ``tokenmill.testing.check_transport`` sends frames both ways through one."""

    #: Registered name.
    name: ClassVar[str]

    @abstractmethod
    def bind(self, address: str) -> EngineEndpoint:
        """Serve ``address`` (engine side); raises ``TokenmillError`` naming it if it cannot be bound."""

    @abstractmethod
    def connect(self, address: str) -> FrontendConnection:
        """Connect to an engine at ``address`` (front end side); connecting does not wait for the engine."""
