"""The engine process: an ``EngineCore`` behind the endpoint of a ``Transport``.

The transport is the plugin that ``transport.backend`` names (built in: ZeroMQ,
``ipc://`` on one host, ``tcp://`` across hosts); the front ends use the same
one. Front ends connect to the engine's address and say ``Hello``; the engine
answers ``Ready``, then takes requests and aborts and sends each front end the
outputs of its own requests after every step, plus a heartbeat while idle so a
front end can tell a live engine from a dead one. The engine's stats ride on
every message; they are computed once per round of messages (a step's, a
heartbeat's) and shared by every front end in it. The loop is single-threaded:
it drains the endpoint without blocking between steps and blocks on it only
when there is nothing to compute.

This is the engine's side only: what runs inside the engine process. A front
end starts, stops and restarts the engines on its own host with
``tokenmill.engine_launcher.LocalEngineProcess``, which runs
``run_engine_process`` in a fresh interpreter. This module imports no torch at
import time (``run_engine_process`` imports the engine when it starts).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from tokenmill.engine_launcher import PROCESS_LABEL
from tokenmill.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStatsMessage,
    Hello,
    Ready,
)
from tokenmill.prefix_summary import PrefixSummaryFeed
from tokenmill.transport.base import EngineEndpoint, TransportSecurity
from tokenmill.transport.security import check_supported, engine_security, security_kwargs
from tokenmill.transport.serde import decode_to_engine, encode

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
#: How long an engine serving a front end has had no request before it builds its grammar backend: the build holds
#: the GIL for about half a second, which would hold up the steps of the requests that come right after a start.
IDLE_BEFORE_PREPARE_S = 2.0


def run_engine_process(
    config_data: dict[str, Any],
    address: str,
    watch_parent: bool = False,
    stop: threading.Event | None = None,
    security: TransportSecurity | None = None,
) -> None:
    """Entry point of an engine process: load the model, serve ``address`` until SIGTERM/SIGINT.

    :param config_data: the resolved ``EngineConfig`` as builtins (it crosses a process boundary).
    :param watch_parent: exit when the process that started this one dies.
    :param stop: set from another thread to stop the engine after its step; with it, the engine runs on any thread
        and installs no signal handlers (a Ray actor's: ``tokenmill_plugins.ray_backend.replicas``).
    :param security: the endpoint's keys, instead of those the config's ``[transport]`` files hold.
    """
    from tokenmill.config import EngineConfig
    from tokenmill.engine import EngineCore
    from tokenmill.plugin_manager import FRONT_END_SLOTS, Slot, resolve_plugins

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    _set_process_title(PROCESS_LABEL)
    parent = os.getppid()
    stopping = False
    engine = None

    def request_stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        if engine is None:
            raise SystemExit(0)  # still loading: there is nothing to finish or flush, so stop now

    if stop is None:
        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    config = msgspec.convert(config_data, EngineConfig)
    plugins = resolve_plugins(config, skip=FRONT_END_SLOTS)  # the router runs in the front end
    transport = plugins.create(Slot.TRANSPORT, config.transport.backend)
    check_supported(transport, config.transport)
    if security is None:
        security = engine_security(config.transport)
    # Bound before loading: front ends' Hello waits there.
    endpoint: EngineEndpoint = transport.bind(address, **security_kwargs(transport, security))
    try:
        engine = EngineCore(config, plugins)
        server = _EngineServer(engine, endpoint, security.max_message_size)
        # What start-up built (the model, the vocabulary, the plugins) lives as long as the process: out of the
        # collector's full passes, which walked it all and held a step up for tens of milliseconds (as vLLM does).
        gc.collect()
        gc.freeze()
        logger.info("serving %s on %s (transport %r)", engine.loaded.path, address, config.transport.backend)
        idle = _IdleWatch()
        while not stopping and not (stop is not None and stop.is_set()):
            if watch_parent and os.getppid() != parent:
                logger.warning("parent process died; exiting")
                break
            if engine.only_waiting_for_kv:
                timeout_ms = 1  # shipped KV arrives on the connector's socket, not this endpoint: check it often
            else:
                timeout_ms = 0 if engine.has_unfinished_requests() else int(HEARTBEAT_INTERVAL_S * 1000)
            server.receive(timeout_ms=timeout_ms)
            if idle.long_enough(busy=engine.has_unfinished_requests()) and server.clients:
                # Serving and idle for a while: build the grammar backend now, not beside the steps of the first
                # constrained request, nor beside those of the requests that follow a start (once; later calls do
                # nothing). A constrained request that comes first builds it itself.
                engine.structured_outputs.prepare()
            if engine.has_unfinished_requests():
                num_steps = engine.num_steps
                outputs = engine.step()
                # A step that ran changes the load and the prefix cache: every front end hears of it (routers).
                server.send_outputs(outputs, notify_all=engine.num_steps != num_steps)
            server.heartbeat()
    finally:
        if engine is not None:
            engine.close()  # flushes the KV tiers' pending writes (a disk tier outlives the process)
        endpoint.close()


class _IdleWatch:
    """Whether the engine has had no unfinished request for ``IDLE_BEFORE_PREPARE_S``, counted from its start or
    from the last step that had one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.idle_since: float | None = clock()  # None while requests run

    def long_enough(self, busy: bool) -> bool:
        if busy:
            self.idle_since = None
            return False
        if self.idle_since is None:
            self.idle_since = self.clock()
        return self.clock() - self.idle_since >= IDLE_BEFORE_PREPARE_S


class _EngineServer:
    """Moves messages between the endpoint and the engine; keeps which client owns which request.

    A frame over ``max_message_size`` bytes, or one that is not a message of the engine's types, is dropped
    and counted (``EngineStatsMessage.num_dropped_messages``); nothing a peer sends takes the engine down.

    Messages go out in rounds (a step's outputs, a heartbeat, a refusal): the engine's stats are read once per
    round and every message of the round carries them; only the prefix cache fields differ, each front end
    getting the change since its own last message.
    """

    def __init__(self, engine: Any, endpoint: EngineEndpoint, max_message_size: int = 64 * 2**20) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.max_message_size = max_message_size
        self.clients: set[bytes] = set()
        self.owners: dict[str, bytes] = {}  # request id -> the peer that sent it, until its last output
        self.last_sent = 0.0
        self.num_dropped: dict[str, int] = {}  # by reason: oversized, malformed
        self.prefix_summary = PrefixSummaryFeed()  # each front end's view of the prefix cache

    def receive(self, timeout_ms: int) -> None:
        if not self.endpoint.poll(timeout_ms):
            return
        while (received := self.endpoint.recv()) is not None:
            identity, frame = received
            if len(frame) > self.max_message_size:
                self._drop("oversized", f"{len(frame)} bytes, over transport.max_message_size", identity)
                continue
            try:
                message = decode_to_engine(frame)
            except Exception as exc:  # DecodeError, ValidationError, and whatever else garbage makes msgspec raise
                self._drop("malformed", f"{type(exc).__name__}: {exc}", identity)
                continue
            self._dispatch(identity, message)

    def _drop(self, reason: str, why: str, identity: bytes) -> None:
        self.num_dropped[reason] = self.num_dropped.get(reason, 0) + 1
        logger.warning("dropping a message from peer %r (%s): %s", identity, reason, why[:200])

    def _dispatch(self, identity: bytes, message: Any) -> None:
        if isinstance(message, Hello):
            error = None
            if message.protocol_version != PROTOCOL_VERSION:
                error = f"protocol version {message.protocol_version} != engine's {PROTOCOL_VERSION}"
            else:
                self.clients.add(identity)
                self.prefix_summary.reset(identity)  # its next message carries the whole prefix cache summary
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
                self._send_round({identity: [refusal]})
                return
            self.owners[message.request_id] = identity
        elif isinstance(message, AbortRequests):
            self.send_outputs(self.engine.abort_requests(message.request_ids, message.completions_only))

    def send_outputs(self, outputs: list[EngineCoreOutput], notify_all: bool = False) -> None:
        """Send each front end the outputs of its requests, and with ``notify_all`` every other front end a
        message with no outputs (after a step that ran but gave it nothing: a prompt chunk still changes the
        load and the prefix cache routers see). One round: the stats are read once for all of them."""
        by_client: dict[bytes, list[EngineCoreOutput]] = {}
        for output in outputs:
            root = output.parent_id or output.request_id
            identity = self.owners.get(root)
            if identity is None:
                continue
            by_client.setdefault(identity, []).append(output)
            if output.request_finished:  # the scheduler's word that every completion of it is done
                del self.owners[root]
        if notify_all:
            for identity in self.clients:
                by_client.setdefault(identity, [])
        self._send_round(by_client)

    def heartbeat(self) -> None:
        """Every front end the stats alone, once ``HEARTBEAT_INTERVAL_S`` passed since the last message."""
        if time.monotonic() - self.last_sent >= HEARTBEAT_INTERVAL_S:
            self._send_round({identity: [] for identity in self.clients})

    def stats(self) -> EngineStatsMessage:
        """The engine's stats, plus what this server and its endpoint dropped or refused."""
        dropped = self.endpoint.num_dropped_messages()
        for reason, count in self.num_dropped.items():
            dropped[reason] = dropped.get(reason, 0) + count
        refused = self.endpoint.num_refused_connections()
        stats: EngineStatsMessage = self.engine.stats()
        if not dropped and not refused:
            return stats
        return msgspec.structs.replace(stats, num_dropped_messages=dropped, num_refused_connections=refused)

    def _send_round(self, by_client: dict[bytes, list[EngineCoreOutput]]) -> None:
        """Send each front end in ``by_client`` its outputs, with the stats read once for the whole round and
        the prefix cache fields of that front end."""
        if not by_client:
            return
        stats = self.stats()
        summary = self.prefix_summary
        summary.update(*self.engine.take_prefix_cache_delta())
        for identity, outputs in by_client.items():
            seq, is_reset, added, removed = summary.take(identity)
            own_stats = msgspec.structs.replace(stats, prefix_cache_seq=seq, prefix_cache_reset=is_reset,
                                                prefix_cache_added=added, prefix_cache_removed=removed)  # fmt: skip
            self.endpoint.send(identity, encode(EngineCoreOutputs(outputs, own_stats)))
        self.last_sent = time.monotonic()


def _set_process_title(title: str) -> None:
    try:
        import setproctitle  # type: ignore[import-not-found]

        setproctitle.setproctitle(title)
    except ImportError:
        pass
