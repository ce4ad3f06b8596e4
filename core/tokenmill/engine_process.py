"""The engine process: an ``EngineCore`` behind the endpoint of a ``Transport``.

The transport is the plugin that ``transport.backend`` names (built in: ZeroMQ,
``ipc://`` on one host, ``tcp://`` across hosts); the front ends use the same
one. Front ends connect to the engine's address and say ``Hello``; the engine
answers ``Ready``, then takes requests and aborts and sends each front end the
outputs of its own requests after every step, plus a heartbeat while idle so a
front end can tell a live engine from a dead one. The loop is single-threaded:
it drains the endpoint without blocking between steps and blocks on it only
when there is nothing to compute.

An engine the front end starts on its own host runs under a
``LocalEngineProcess``: a fresh interpreter in a process group of its own,
which the front end stops (SIGTERM, then SIGKILL for the whole group) and
starts again after it dies.

This module imports no torch at import time: the front end imports it to
start engine processes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec

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
#: In the command line of every engine process a front end starts (``ps``, ``pgrep -f``).
PROCESS_LABEL = "tokenmill-engine"


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
        and installs no signal handlers (a Ray actor's, ``tokenmill.ray_replicas``).
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
        logger.info("serving %s on %s (transport %r)", engine.loaded.path, address, config.transport.backend)
        while not stopping and not (stop is not None and stop.is_set()):
            if watch_parent and os.getppid() != parent:
                logger.warning("parent process died; exiting")
                break
            if engine.only_waiting_for_kv:
                timeout_ms = 1  # shipped KV arrives on the connector's socket, not this endpoint: check it often
            else:
                timeout_ms = 0 if engine.has_unfinished_requests() else int(HEARTBEAT_INTERVAL_S * 1000)
            server.receive(timeout_ms=timeout_ms)
            if engine.has_unfinished_requests():
                num_steps = engine.num_steps
                served = server.send_outputs(engine.step())
                if engine.num_steps != num_steps:  # the step ran: every front end hears of it (routers' stats)
                    server.send_stats(skip=served)
            server.heartbeat()
    finally:
        if engine is not None:
            engine.close()  # flushes the KV tiers' pending writes (a disk tier outlives the process)
        endpoint.close()


class _EngineServer:
    """Moves messages between the endpoint and the engine; keeps which client owns which request.

    A frame over ``max_message_size`` bytes, or one that is not a message of the engine's types, is dropped
    and counted (``EngineStatsMessage.num_dropped_messages``); nothing a peer sends takes the engine down.
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
                self._send(identity, [refusal])
                return
            self.owners[message.request_id] = identity
        elif isinstance(message, AbortRequests):
            self.send_outputs(self.engine.abort_requests(message.request_ids, message.completions_only))

    def send_outputs(self, outputs: list[EngineCoreOutput]) -> set[bytes]:
        """Send each front end the outputs of its requests; returns the front ends sent a message."""
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
        return set(by_client)

    def send_stats(self, skip: set[bytes]) -> None:
        """Send the stats, with no outputs, to every front end but those in ``skip`` (after a step that gave
        them no output: a prompt chunk still changes the load and the prefix cache routers see)."""
        for identity in self.clients:
            if identity not in skip:
                self._send(identity, [])

    def heartbeat(self) -> None:
        if time.monotonic() - self.last_sent >= HEARTBEAT_INTERVAL_S:
            for identity in self.clients:
                self._send(identity, [])

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

    def _send(self, identity: bytes, outputs: list[EngineCoreOutput]) -> None:
        summary = self.prefix_summary
        summary.update(*self.engine.take_prefix_cache_delta())
        seq, is_reset, added, removed = summary.take(identity)
        stats = msgspec.structs.replace(self.stats(), prefix_cache_seq=seq, prefix_cache_reset=is_reset,
                                        prefix_cache_added=added, prefix_cache_removed=removed)  # fmt: skip
        message = EngineCoreOutputs(outputs, stats)
        self.endpoint.send(identity, encode(message))
        self.last_sent = time.monotonic()


# What a LocalEngineProcess runs: the front end's sys.path, then the engine, with the config read from stdin. Its
# arguments only label it in `ps`: `python -c ... tokenmill-engine ipc:///tmp/tokenmill-.../engine-0.sock`.
_BOOTSTRAP = (
    "import json, sys; payload = json.load(sys.stdin); sys.path[:] = payload['sys_path']; "
    "from tokenmill.engine_process import run_engine_process; "
    "run_engine_process(payload['config'], payload['address'], watch_parent=True)"
)


class LocalEngineProcess:
    """An engine process the front end runs on its own host: started, stopped, and started again after it died.

    The engine runs ``run_engine_process`` in a fresh interpreter (``sys.executable`` with the front end's
    ``sys.path``; the config arrives as JSON on its stdin), in a process group of its own: a Ctrl-C at the
    terminal reaches only the front end, which drains before it stops the engines, and killing the group also
    kills whatever the engine started (compiler workers), even when the engine itself was killed first. Used in
    the front end's event loop; nothing here blocks for long.

    :param config_data: the engine's ``EngineConfig`` as builtins (``EngineConfig.to_dict()``).
    :param address: the ``ipc://`` address the engine serves; its socket file is removed when it stops.
    """

    def __init__(self, config_data: dict[str, Any], address: str) -> None:
        self.config_data = config_data
        self.address = address
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def exitcode(self) -> int | None:
        """The exit status once it has exited (``-N``: killed by signal N), else None."""
        return self._popen.returncode if self._popen is not None else None

    @property
    def exit_reason(self) -> str:
        """How it ended, as the end of a sentence (``was killed by SIGKILL``)."""
        return describe_exit(self.exitcode)

    async def locate(self, timeout: float) -> tuple[str, TransportSecurity | None]:
        """Where the engine serves (its fixed ipc:// address), and no keys of its own."""
        return self.address, None

    async def restart(self) -> None:
        """Start it again once it died: reap it and whatever it started, then start a fresh one."""
        await self.stop(timeout=0)
        self.start()

    def start(self) -> None:
        """Start the engine: the first time, or again once the previous one was stopped."""
        assert self._popen is None or self._popen.returncode is not None, "the previous engine still runs"
        socket_path = _ipc_path(self.address)
        if socket_path is not None:
            os.makedirs(os.path.dirname(socket_path), exist_ok=True)
        payload = json.dumps({"sys_path": sys.path, "config": self.config_data, "address": self.address})
        command = [sys.executable, "-c", _BOOTSTRAP, PROCESS_LABEL, self.address]
        popen = subprocess.Popen(command, stdin=subprocess.PIPE, process_group=0)
        self._popen = popen
        assert popen.stdin is not None
        try:
            popen.stdin.write(payload.encode())
            popen.stdin.close()
        except OSError:  # it died at once; is_alive says so
            pass

    def is_alive(self) -> bool:
        """Whether the engine runs. Once it has exited, what is left of its process group is killed and the
        engine reaped (its ``exitcode`` set)."""
        popen = self._popen
        if popen is None or popen.returncode is not None:
            return False
        try:
            # WNOWAIT leaves an exited engine unreaped, so its pid, the group's id, cannot be reused meanwhile.
            has_exited = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped elsewhere
            has_exited = True
        if not has_exited:
            return True
        self._kill_group()
        popen.wait()
        return False

    def kill(self) -> None:
        """SIGKILL the engine and every process in its group, now; ``is_alive`` or ``stop`` reap it."""
        if self._popen is not None and self._popen.returncode is None:
            self._kill_group()

    async def stop(self, timeout: float) -> None:
        """SIGTERM; up to ``timeout`` s to exit (it finishes its step and flushes its KV tiers); then SIGKILL
        for its whole group. Returns once the engine is reaped; removes its socket file and, once empty, the
        socket's directory."""
        popen = self._popen
        if popen is not None and self.is_alive():
            try:
                popen.terminate()
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout
            while self.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if popen.returncode is None:
                self._kill_group()
                while self.is_alive():
                    await asyncio.sleep(0.01)
        socket_path = _ipc_path(self.address)
        if socket_path is not None:
            for remove, path in ((os.unlink, socket_path), (os.rmdir, os.path.dirname(socket_path))):
                try:
                    remove(path)
                except OSError:
                    pass

    def _kill_group(self) -> None:
        assert self._popen is not None
        try:
            os.killpg(self._popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, as the end of a sentence: ``exited with code 1``, ``was killed by SIGKILL``."""
    if exitcode is None:
        return "exited"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _ipc_path(address: str) -> str | None:
    return address.removeprefix("ipc://") if address.startswith("ipc://") else None


def _set_process_title(title: str) -> None:
    try:
        import setproctitle  # type: ignore[import-not-found]

        setproctitle.setproctitle(title)
    except ImportError:
        pass
