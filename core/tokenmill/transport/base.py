"""The transport interface: sockets and framing between the front end and engine processes.

Messages are encoded once by ``tokenmill.transport.serde`` (msgspec, never
pickle); a transport moves the encoded frames. An engine *binds* an address
and serves any number of front ends, each known by an opaque peer id; a front
end *connects* to one engine per address. Addresses are URLs whose scheme the
transport understands (``ipc://``, ``tcp://`` for ZeroMQ), so an engine on
another machine is a config line.

A transport that can authenticate its peers (``supports_security``) takes a
``TransportSecurity`` when binding and connecting: the keys that authenticate
and encrypt connections that leave the host, and the size of the largest
message an engine reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class TransportSecurity:
    """What secures one process's side of a transport, built once from ``TransportConfig``.

    Keys are Z85-encoded CURVE keys (40 characters each), as ``zmq.curve_keypair`` and ``zmq.auth`` make them.
    ``secret_key`` None: connections are not authenticated.
    """

    #: This process's key pair.
    public_key: bytes | None = None
    secret_key: bytes | None = None
    #: Engine side: the public keys of the front ends allowed to connect.
    allowed_public_keys: frozenset[bytes] = frozenset()
    #: Front-end side: the engine's public key, which the engine proves it holds the secret key of.
    engine_public_key: bytes | None = None
    #: Engine side: frames above this many bytes are dropped (and counted).
    max_message_size: int = 64 * 2**20

    def __repr__(self) -> str:  # never print a secret key
        return (
            f"TransportSecurity(public_key={self.public_key!r}, secret_key={'<set>' if self.secret_key else None}, "
            f"allowed_public_keys={len(self.allowed_public_keys)} keys, engine_public_key={self.engine_public_key!r}, "
            f"max_message_size={self.max_message_size})"
        )


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

    def num_dropped_messages(self) -> dict[str, int]:
        """Messages dropped so far by the transport itself (never handed to ``recv``), by reason; read with every
        stats message. Default: none."""
        return {}

    def num_refused_connections(self) -> int:
        """Connections refused so far during the transport's handshake (unknown key, no authentication)."""
        return 0


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

    def handshake_failure(self) -> str | None:
        """Why the engine refused this connection's handshake (its key is not allowed, the engine's key is not
        the one expected, one side has no keys), when the transport can tell and the last attempt failed; else
        None. The front end polls it while it waits for ``Ready``, to fail in a moment instead of a timeout."""
        return None


class Transport(ABC):
    """Makes engine endpoints and front-end connections. Built once per process with no arguments
    (plus ``options=`` when its plugin declares options); the front end and its engines must use the same
    transport. ``tokenmill.testing.check_transport`` sends frames both ways through one."""

    #: Registered name.
    name: ClassVar[str]
    #: Whether ``bind`` and ``connect`` take ``security=TransportSecurity(...)`` (authentication, a message size
    #: limit). The callers pass it only to a transport that says so, and refuse to start when the config asks
    #: for keys and the transport cannot use them.
    supports_security: ClassVar[bool] = False

    @abstractmethod
    def bind(self, address: str, security: TransportSecurity | None = None) -> EngineEndpoint:
        """Serve ``address`` (engine side); raises ``TokenmillError`` naming it if it cannot be bound.
        ``security`` (passed only when ``supports_security``, so a transport without it may leave the parameter
        out): which peers to accept, the largest message to read."""

    @abstractmethod
    def connect(self, address: str, security: TransportSecurity | None = None) -> FrontendConnection:
        """Connect to an engine at ``address`` (front end side); connecting does not wait for the engine.
        ``security`` (passed only when ``supports_security``): this side's keys and the engine's public key."""
