"""The built-in transport: ZeroMQ, ``ipc://`` on one host and ``tcp://`` across hosts.

The engine binds a ROUTER socket, which prefixes every frame with the sending
peer's identity and drops frames addressed to a peer it no longer knows; each
front end connects a DEALER socket driven by ``zmq.asyncio``. Both use
``LINGER 0``, so closing never waits for frames a dead peer will not take.

On ``tcp://`` addresses, given keys (``TransportSecurity``), every connection
is authenticated and encrypted with ZeroMQ CURVE: the engine's ROUTER is the
CURVE server, and a ZAP handler (pyzmq's ``ThreadAuthenticator``, on the
engine's own context) lets in only the front ends' public keys; a front end's
DEALER proves its key and checks the engine's. ``ipc://`` addresses are left
as they are: the socket file's permissions guard them.

The engine's socket refuses frames over twice ``max_message_size``
(``MAXMSGSIZE``: ZeroMQ closes that connection before buffering the frame;
the engine drops and counts those over ``max_message_size`` it reads);
multipart messages are dropped and counted here. A monitor socket counts handshakes that failed (a peer refused by
the ZAP handler, one without CURVE, or one speaking garbage). A front end monitors its own handshakes too, so that
one the engine refuses learns why in a moment (``handshake_failure``) instead of timing out.
"""

from __future__ import annotations

import logging
import time
from typing import ClassVar

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from tokenmill.errors import TokenmillError
from tokenmill.transport.base import EngineEndpoint, FrontendConnection, Transport, TransportSecurity

logger = logging.getLogger(__name__)

#: Monitor events of a handshake that failed: the peer was refused or did not speak ZMTP (with CURVE).
_HANDSHAKE_FAILED: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its key is not allowed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "it broke the protocol (no CURVE, or garbage)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed",
}
#: The same events as the front end sees them, with what each says about this front end's settings.
_REFUSED_BY_ENGINE: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the engine does not allow this front end's key (its public key must be in "
    "the engine's transport.curve_public_keys_dir)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the handshake failed: one side has CURVE keys and the other has none "
    "(transport.curve_secret_key_file)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed: is transport.curve_engine_public_key_file the "
    "engine's public key?",
}
_ANY_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
#: A refused peer reconnects every 100 ms: log a refusal at most this often (each one is counted).
_REFUSAL_LOG_INTERVAL_S = 10.0


def _is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


class ZmqEngineEndpoint(EngineEndpoint):
    """A bound ROUTER socket with its own (synchronous) context; with CURVE keys, a ZAP handler thread."""

    def __init__(self, address: str, security: TransportSecurity | None = None) -> None:
        security = security or TransportSecurity()
        self._num_dropped: dict[str, int] = {}
        self._num_refused = 0
        self._last_refusal_logged = float("-inf")
        self._context = zmq.Context()
        self._authenticator: ThreadAuthenticator | None = None
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, 2 * security.max_message_size)
        self._monitor = self._socket.get_monitor_socket(_ANY_HANDSHAKE_FAILED)
        try:
            if _is_tcp(address) and security.secret_key is not None:
                self._secure(address, security)
            elif _is_tcp(address):
                logger.warning(
                    "serving %s without authentication: anyone who reaches the port can use this engine (set "
                    "transport.curve_secret_key_file and transport.curve_public_keys_dir)", address
                )  # fmt: skip
            self._socket.bind(address)
        except zmq.ZMQError as exc:
            self.close()
            raise TokenmillError(f"cannot serve {address!r}: {exc}") from None
        except TokenmillError:
            self.close()
            raise

    def _secure(self, address: str, security: TransportSecurity) -> None:
        if not security.allowed_public_keys:
            raise TokenmillError(
                f"cannot serve {address!r} with CURVE: no front end would be allowed in; put the front ends' "
                "public certificates ('*.key') in transport.curve_public_keys_dir"
            )
        authenticator = ThreadAuthenticator(self._context, log=logging.getLogger(f"{__name__}.zap"))
        authenticator.start()
        self._authenticator = authenticator
        # The allowed keys themselves, not a directory read again later: what was checked at start-up is what runs.
        authenticator.allow_any = False
        authenticator.certs["*"] = dict.fromkeys(security.allowed_public_keys, True)
        self._socket.curve_server = True
        self._socket.curve_secretkey = security.secret_key
        self._socket.curve_publickey = security.public_key
        logger.info("CURVE on %s: %d front-end key(s) allowed", address, len(security.allowed_public_keys))

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
            self._num_dropped["multipart"] = self._num_dropped.get("multipart", 0) + 1
            logger.warning("dropping a message of %d parts from peer %r", len(parts), parts[0])

    def send(self, peer: bytes, frame: bytes) -> None:
        # A ROUTER drops, rather than blocks on, frames for unknown peers or peers over their high-water mark.
        self._socket.send_multipart([peer, frame], zmq.NOBLOCK)

    def num_dropped_messages(self) -> dict[str, int]:
        return dict(self._num_dropped)

    def num_refused_connections(self) -> int:
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return self._num_refused
            self._num_refused += 1
            now = time.monotonic()
            if now - self._last_refusal_logged >= _REFUSAL_LOG_INTERVAL_S:  # a refused peer retries every 0.1 s
                self._last_refusal_logged = now
                endpoint = event["endpoint"].decode(errors="replace")
                logger.warning("refused a connection on %s: %s (%d refused so far)", endpoint,
                               _HANDSHAKE_FAILED.get(event["event"], "?"), self._num_refused)  # fmt: skip

    def close(self) -> None:
        self._monitor.close()
        self._socket.close()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()


class ZmqFrontendConnection(FrontendConnection):
    """A DEALER socket on the process-wide ``zmq.asyncio`` context; a CURVE client on tcp:// with keys."""

    def __init__(self, address: str, security: TransportSecurity | None = None) -> None:
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if security is not None and security.secret_key is not None and _is_tcp(address):
            if security.engine_public_key is None:
                self._socket.close()
                raise TokenmillError(
                    f"cannot connect to {address!r} with CURVE without the engine's public key: set "
                    "transport.curve_engine_public_key_file"
                )
            self._socket.curve_secretkey = security.secret_key
            self._socket.curve_publickey = security.public_key
            self._socket.curve_serverkey = security.engine_public_key
        # A synchronous view of the monitor, so handshake_failure can read it without the event loop.
        self._monitor_socket = self._socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | _ANY_HANDSHAKE_FAILED)
        self._monitor: zmq.Socket[bytes] = zmq.Socket.shadow(self._monitor_socket.underlying)
        self._handshake_failure: str | None = None
        try:
            self._socket.connect(address)
        except zmq.ZMQError as exc:
            self.close()
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

    def handshake_failure(self) -> str | None:
        while True:  # the latest attempt decides: ZeroMQ retries a failed handshake by itself
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return self._handshake_failure
            # The engine may drop a refused connection before its reason arrives (more often on a loaded
            # machine): an attempt without detail keeps what an earlier one said.
            if event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL or self._handshake_failure is None:
                self._handshake_failure = _REFUSED_BY_ENGINE.get(event)

    def close(self) -> None:
        if self._socket.closed:
            return  # closing twice is harmless
        self._socket.disable_monitor()
        self._monitor_socket.close()
        self._socket.close()


class ZmqTransport(Transport):
    """ZeroMQ ROUTER (engine) and DEALER (front end) sockets."""

    name: ClassVar[str] = "zmq"
    supports_security: ClassVar[bool] = True

    def bind(self, address: str, security: TransportSecurity | None = None) -> EngineEndpoint:
        return ZmqEngineEndpoint(address, security)

    def connect(self, address: str, security: TransportSecurity | None = None) -> FrontendConnection:
        return ZmqFrontendConnection(address, security)
