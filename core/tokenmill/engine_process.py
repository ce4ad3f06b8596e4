"""The engine process: an ``EngineCore`` behind the endpoint of a ``Transport``.

The transport is the plugin that ``transport.backend`` names (built in: ZeroMQ,
``ipc://`` on one host, ``tcp://`` across hosts); the front ends use the same
one. Front ends connect to the engine's address and say ``Hello``; the engine
answers ``Ready``, then takes requests and aborts and sends each front end the
outputs of its own requests after every step, plus a heartbeat while idle so a
front end can tell a live engine from a dead one. The loop is single-threaded:
it drains the endpoint without blocking between steps and blocks on it only
when there is nothing to compute.

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

from tokenmill.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Hello,
    Ready,
)
from tokenmill.transport.base import EngineEndpoint
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
    from tokenmill.plugin_manager import FRONT_END_SLOTS, Slot, resolve_plugins

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
    plugins = resolve_plugins(config, skip=FRONT_END_SLOTS)  # the router runs in the front end
    transport = plugins.create(Slot.TRANSPORT, config.transport.backend)
    endpoint: EngineEndpoint = transport.bind(address)  # before loading: front ends' Hello waits there
    engine = None
    try:
        engine = EngineCore(config, plugins)
        server = _EngineServer(engine, endpoint)
        logger.info("serving %s on %s (transport %r)", engine.loaded.path, address, config.transport.backend)
        while not stopping:
            if watch_parent and os.getppid() != parent:
                logger.warning("parent process died; exiting")
                break
            if engine.only_waiting_for_kv:
                timeout_ms = 1  # shipped KV arrives on the connector's socket, not this endpoint: check it often
            else:
                timeout_ms = 0 if engine.has_unfinished_requests() else int(HEARTBEAT_INTERVAL_S * 1000)
            server.receive(timeout_ms=timeout_ms)
            if engine.has_unfinished_requests():
                server.send_outputs(engine.step())
            server.heartbeat()
    finally:
        if engine is not None:
            engine.close()  # flushes the KV tiers' pending writes (a disk tier outlives the process)
        endpoint.close()


class _EngineServer:
    """Moves messages between the endpoint and the engine; keeps which client owns which request."""

    def __init__(self, engine: Any, endpoint: EngineEndpoint) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.clients: set[bytes] = set()
        self.owners: dict[str, bytes] = {}  # request id -> the peer that sent it, until its last output
        self.last_sent = 0.0

    def receive(self, timeout_ms: int) -> None:
        if not self.endpoint.poll(timeout_ms):
            return
        while (received := self.endpoint.recv()) is not None:
            identity, frame = received
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
                block_size=engine.layout.block_size, hash_salt=engine.kv_cache_hash_salt,
            )  # fmt: skip
            self.endpoint.send(identity, encode(ready))
        elif isinstance(message, EngineCoreRequest):
            try:
                self.engine.add_request(message)
            except Exception as exc:  # a bad request must never take the engine down
                refusal = EngineCoreOutput(
                    message.request_id, [], finish_reason="abort", error=str(exc), request_finished=True
                )
                self._send(identity, [refusal])
                return
            self.owners[message.request_id] = identity
        elif isinstance(message, AbortRequests):
            self.send_outputs(self.engine.abort_requests(message.request_ids, message.completions_only))

    def send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        by_client: dict[bytes, list[EngineCoreOutput]] = {}
        for output in outputs:
            root = output.parent_id or output.request_id
            identity = self.owners.get(root)
            if identity is None:
                continue
            by_client.setdefault(identity, []).append(output)
            if output.request_finished:  # the scheduler's word that every completion of it is done
                del self.owners[root]
        for identity, client_outputs in by_client.items():
            self._send(identity, client_outputs)

    def heartbeat(self) -> None:
        if time.monotonic() - self.last_sent >= HEARTBEAT_INTERVAL_S:
            for identity in self.clients:
                self._send(identity, [])

    def _send(self, identity: bytes, outputs: list[EngineCoreOutput]) -> None:
        message = EngineCoreOutputs(outputs, self.engine.stats())
        self.endpoint.send(identity, encode(message))
        self.last_sent = time.monotonic()


def _set_process_title(title: str) -> None:
    try:
        import setproctitle  # type: ignore[import-not-found]

        setproctitle.setproctitle(title)
    except ImportError:
        pass
