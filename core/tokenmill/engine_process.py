"""The engine process: an ``EngineCore`` behind a ZeroMQ ROUTER socket.

Front ends connect DEALER sockets to the engine's address (``ipc://`` on one
host, ``tcp://`` across hosts) and say ``Hello``; the engine answers
``Ready``, then takes requests and aborts and sends each front end the outputs
of its own requests after every step, plus a heartbeat while idle so a front
end can tell a live engine from a dead one. The loop is single-threaded: it
drains the socket without blocking between steps and blocks on it only when
there is nothing to compute.

This module imports no torch at import time: the front end imports it to
start engine processes.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import msgspec
import zmq

from tokenmill.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Hello,
    Ready,
)
from tokenmill.transport.serde import decode_to_engine, encode

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5


def run_engine_process(config_data: dict[str, Any], address: str, watch_parent: bool = False) -> None:
    """Entry point of an engine process: load the model, serve ``address`` until SIGTERM/SIGINT.

    :param config_data: the resolved ``EngineConfig`` as builtins (it crosses a process boundary).
    :param watch_parent: exit when the process that started this one dies.
    """
    from tokenmill.config import EngineConfig
    from tokenmill.engine import EngineCore

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    _set_process_title("tokenmill-engine")
    parent = os.getppid()
    stopping = False

    def request_stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    config = msgspec.convert(config_data, EngineConfig)
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(address)
    engine = EngineCore(config)
    server = _EngineServer(engine, socket)
    logger.info("serving %s on %s", engine.loaded.path, address)
    try:
        while not stopping:
            if watch_parent and os.getppid() != parent:
                logger.warning("parent process died; exiting")
                break
            busy = engine.has_unfinished_requests()
            server.receive(timeout_ms=0 if busy else int(HEARTBEAT_INTERVAL_S * 1000))
            if engine.has_unfinished_requests():
                server.send_outputs(engine.step())
            server.heartbeat()
    finally:
        socket.close()
        context.term()


class _EngineServer:
    """Moves messages between the socket and the engine; keeps which client owns which request."""

    def __init__(self, engine: Any, socket: zmq.Socket) -> None:
        self.engine = engine
        self.socket = socket
        self.clients: set[bytes] = set()
        self.owners: dict[str, bytes] = {}
        self.num_unfinished: dict[str, int] = {}  # completions of each request still running (n of them)
        self.last_sent = 0.0

    def receive(self, timeout_ms: int) -> None:
        if not self.socket.poll(timeout_ms):
            return
        while True:
            try:
                identity, frame = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = decode_to_engine(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("dropping a malformed message: %s", exc)
                continue
            self._dispatch(identity, message)

    def _dispatch(self, identity: bytes, message: Any) -> None:
        if isinstance(message, Hello):
            error = None
            if message.protocol_version != PROTOCOL_VERSION:
                error = f"protocol version {message.protocol_version} != engine's {PROTOCOL_VERSION}"
            else:
                self.clients.add(identity)
            engine = self.engine
            ready = Ready(
                PROTOCOL_VERSION, str(engine.loaded.path), engine.max_model_len,
                engine.config.scheduler.max_num_seqs, error,
            )  # fmt: skip
            self.socket.send_multipart([identity, encode(ready)])
        elif isinstance(message, EngineCoreRequest):
            try:
                self.engine.add_request(message)
            except Exception as exc:  # a bad request must never take the engine down
                refusal = EngineCoreOutput(message.request_id, [], finish_reason="abort", error=str(exc))
                self._send(identity, [refusal])
                return
            self.owners[message.request_id] = identity
            self.num_unfinished[message.request_id] = message.params.n
        elif isinstance(message, AbortRequests):
            self.send_outputs(self.engine.abort_requests(message.request_ids))

    def send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        by_client: dict[bytes, list[EngineCoreOutput]] = {}
        for output in outputs:
            root = output.parent_id or output.request_id
            identity = self.owners.get(root)
            if identity is None:
                continue
            by_client.setdefault(identity, []).append(output)
            if output.finished:
                self.num_unfinished[root] -= 1
                if self.num_unfinished[root] <= 0:  # the last of its n completions
                    del self.owners[root], self.num_unfinished[root]
        for identity, client_outputs in by_client.items():
            self._send(identity, client_outputs)

    def heartbeat(self) -> None:
        if time.monotonic() - self.last_sent >= HEARTBEAT_INTERVAL_S:
            for identity in self.clients:
                self._send(identity, [])

    def _send(self, identity: bytes, outputs: list[EngineCoreOutput]) -> None:
        message = EngineCoreOutputs(outputs, self.engine.stats())
        self.socket.send_multipart([identity, encode(message)])
        self.last_sent = time.monotonic()


def _set_process_title(title: str) -> None:
    try:
        import setproctitle  # type: ignore[import-not-found]

        setproctitle.setproctitle(title)
    except ImportError:
        pass
