"""`tokenmill serve`: start (or connect to) the engines, then serve HTTP until told to stop.

The engines are processes this server starts on its host (``server.backend``
``'local'``), engines already running (``server.engines``), or replicas that an
engine backend plugin places elsewhere (any other ``server.backend``, such as
``ray``: ``tokenmill.engine_backend``). A router plugin (``server.router``)
picks the engine of each request (``RoutedEngineGroup``). With
``server.disaggregated_prefill`` the engines are a prefill engine and a decode
engine joined by a ZeroMQ KV connector (``DisaggregatedGroup``), and no router
is built.

Supervision (``EngineClient``): when an engine's process exits or its
heartbeats stop, its in-flight requests fail at once with 503 and the engine is
brought back, with backoff: an engine this server started is restarted, a
remote one (``--engine``) is connected to again. Meanwhile the router skips it,
and new requests get 503 only if no engine is up; ``/health`` answers 503 while
no engine can serve (200 ``degraded`` while some can). If an engine cannot be
brought back (``server.max_engine_restarts`` failed attempts in a row), the
server drains and exits with status 1, its last log line saying why.

Shutdown: the first SIGTERM or SIGINT starts a drain: new requests get 503 (the
port stays open, ``/health`` says ``draining``) and running ones get up to
``server.drain_timeout`` seconds to finish; the rest then fail with 503, the
engines are stopped (SIGTERM, then SIGKILL for each engine's process group) and
the server exits 0 with no child process left. A second signal kills the
engines at once and exits with status 128 + the signal's number.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import uvicorn

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.config.cache import KVTierConfig
from tokenmill.config.server import LOCAL_BACKEND
from tokenmill.engine_backend import EngineBackend
from tokenmill.engine_client import (
    DisaggregatedGroup,
    EngineClient,
    EngineGroup,
    RoutedEngineGroup,
    start_local_engines,
)
from tokenmill.model_files import DEFAULT_MODEL, resolve_tokenizer
from tokenmill.plugin_manager import PluginSystem, Slot, resolve_plugins
from tokenmill.routing import Router
from tokenmill.server.tenants import Tenants
from tokenmill.transport.base import Transport
from tokenmill.transport.security import check_supported, frontend_security

if TYPE_CHECKING:
    from tokenmill.server.app import ServerState
    from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ENGINE_START_TIMEOUT_S = 600.0
_POLL_INTERVAL_S = 0.05
# After the drain, uvicorn waits this long for connections to finish sending (their requests are over by then).
_CLOSE_CONNECTIONS_TIMEOUT_S = 5


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: ``_Shutdown`` drains first, then sets ``should_exit``."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _Shutdown:
    """What SIGTERM and SIGINT asked for. The first signal sets ``requested`` (the server drains, then
    stops); a second one kills the engines at once and makes uvicorn exit without waiting (``forced_by``)."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.forced_by: int | None = None
        self.group: EngineGroup | None = None
        self.server: uvicorn.Server | None = None

    def on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if not self.requested.is_set():
            logger.warning("%s: draining, then stopping (a second signal stops at once)", name)
            self.requested.set()
        elif self.forced_by is None:
            logger.warning("%s again: stopping at once", name)
            self.forced_by = signum
            if self.group is not None:
                self.group.kill()
            if self.server is not None:
                self.server.should_exit = self.server.force_exit = True


def served_model_name(config: EngineConfig) -> str:
    if config.server.served_model_name:
        return config.server.served_model_name
    model = config.model.model
    return model if model == DEFAULT_MODEL.name else Path(model).name


def disaggregated_configs(config: EngineConfig, socket_dir: str) -> tuple[EngineConfig, EngineConfig]:
    """The prefill and the decode engine's configs: each the server's, plus the two ends of a KV connector
    (``zmq-push`` on the prefill engine, ``zmq-pull`` on the decode engine) over an ipc:// address in
    ``socket_dir``."""
    if config.server.engines or config.server.data_parallel_size > 1:
        raise ConfigError("server.disaggregated_prefill starts its own two engines: it cannot be combined with "
                          "server.engines or data_parallel_size > 1")  # fmt: skip
    if not config.cache.enable_prefix_caching:
        raise ConfigError("server.disaggregated_prefill needs cache.enable_prefix_caching: the decode engine "
                          "finds the shipped blocks through its prefix cache")  # fmt: skip
    address = f"ipc://{os.path.join(socket_dir, 'kv-transfer.sock')}"
    buffer = config.server.kv_transfer_buffer
    push = KVTierConfig("zmq-push", buffer, address)
    pull = KVTierConfig("zmq-pull", buffer, address)
    return (
        msgspec.structs.replace(config, kv_tiers=[*config.kv_tiers, push]),
        msgspec.structs.replace(config, kv_tiers=[*config.kv_tiers, pull]),
    )


def run_server(config: EngineConfig) -> int:
    """Serve until stopped; returns the process exit status: 0 after a signal's drain, 1 when an engine could
    not be brought back, 128 + N when a second signal N stopped it at once."""
    return asyncio.run(_serve(config))


async def _serve(config: EngineConfig) -> int:
    # Every plugin name and option is checked here, before any engine starts or model loads, so a
    # misspelled router or transport fails at once with one line.
    plugins = resolve_plugins(config)
    transport = plugins.create(Slot.TRANSPORT, config.transport.backend)
    tenants = Tenants.from_config(config.server)  # a bad keys file fails here, before any engine starts
    backend: EngineBackend | None = None
    if config.server.backend != LOCAL_BACKEND:
        backend = plugins.create(Slot.ENGINE_BACKEND, config.server.backend, config)
        backend.connect()  # before the signal handlers: ray.init, for one, installs a SIGTERM handler of its own
    shutdown = _Shutdown()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, shutdown.on_signal, signum)
    socket_dir = tempfile.mkdtemp(prefix="tokenmill-")  # the engines' sockets; removed on the way out
    try:
        group: EngineGroup
        if backend is not None:
            # Placing the replicas is part of starting them (_start), where a signal can stop the wait.
            router, router_plugin = _router(config, plugins)
            group = RoutedEngineGroup(backend.start_engines(transport), router, config.server.router, router_plugin)
        else:
            group = _engine_group(config, transport, plugins, socket_dir)
        shutdown.group = group
        try:
            state = await _start(config, group, shutdown, tenants, plugins)
            if state is None:  # a signal came first
                return 128 + shutdown.forced_by if shutdown.forced_by is not None else 0
            return await _run(config, state, shutdown)
        finally:
            await group.close()
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
        shutil.rmtree(socket_dir, ignore_errors=True)
        if backend is not None:
            backend.close()


def _router(config: EngineConfig, plugins: PluginSystem) -> tuple[Router, str]:
    """The router ``server.router`` names, and the plugin that registered it (the fallback's log names both)."""
    router = plugins.create(Slot.ROUTER, config.server.router)
    return router, plugins.registry.get(Slot.ROUTER, config.server.router).plugin


def _engine_group(config: EngineConfig, transport: Transport, plugins: PluginSystem,
                  socket_dir: str) -> EngineGroup:  # fmt: skip
    """The engines (started now when local, unstarted clients) and who routes between them."""
    if config.server.disaggregated_prefill:
        configs = disaggregated_configs(config, socket_dir)
        prefill, decode = start_local_engines(config, 2, transport, configs, socket_dir)
        return DisaggregatedGroup(prefill, decode)
    router, router_plugin = _router(config, plugins)  # before any engine starts
    if config.server.engines:
        check_supported(transport, config.transport)
        security = frontend_security(config.transport)  # CURVE keys for tcp:// engines
        timeout, restarts = config.server.engine_timeout, config.server.max_engine_restarts
        clients = [
            EngineClient(address, transport, index, None, timeout, restarts, security)
            for index, address in enumerate(config.server.engines)
        ]
    else:
        clients = start_local_engines(config, config.server.data_parallel_size, transport, socket_dir=socket_dir)
    return RoutedEngineGroup(clients, router, config.server.router, router_plugin)


async def _start(config: EngineConfig, group: EngineGroup, shutdown: _Shutdown, tenants: Tenants | None = None,
                 plugins: PluginSystem | None = None) -> ServerState | None:  # fmt: skip
    """Wait for every engine's handshake and load the tokenizer meanwhile; None if a signal came first."""
    # The HTTP side (the app, the tokenizer and gguf, numpy: about half a second) is imported once the engines are
    # started, so that it runs beside their own imports rather than before them.
    from tokenmill.server.app import ServerState
    from tokenmill.server.metrics import ServerMetrics
    from tokenmill.tokenizer import Tokenizer

    async def start() -> Tokenizer:
        path = resolve_tokenizer(config.model.model, config.model.tokenizer)
        loading = asyncio.ensure_future(asyncio.to_thread(Tokenizer.from_path, path))
        await asyncio.gather(loading, *(client.start(ENGINE_START_TIMEOUT_S) for client in group.clients))
        return loading.result()

    starting = asyncio.create_task(start())
    signalled = asyncio.create_task(shutdown.requested.wait())
    await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        logger.info("stopped while starting")
        return None
    tokenizer = starting.result()  # raises what starting raised
    name = served_model_name(config)
    return ServerState(config, group, tokenizer, name, ServerMetrics(group, name), tenants=tenants, plugins=plugins)


async def _run(config: EngineConfig, state: ServerState, shutdown: _Shutdown) -> int:
    """Serve HTTP until a signal or an engine that cannot be brought back; drain; returns the exit status."""
    from tokenmill.server.app import build_app  # imported already by _start

    group = state.group
    server = _Server(
        uvicorn.Config(
            build_app(state),
            host=config.server.host,
            port=config.server.port,
            log_level="warning",
            timeout_graceful_shutdown=_CLOSE_CONNECTIONS_TIMEOUT_S,
        )
    )
    shutdown.server = server
    failure: str | None = None

    async def supervise() -> None:
        nonlocal failure
        while not shutdown.requested.is_set() and failure is None:
            failure = next((client.failure for client in group.clients if client.failure is not None), None)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(shutdown.requested.wait(), _POLL_INTERVAL_S * 4)
        await _drain(state, config.server.drain_timeout, shutdown)
        server.should_exit = True

    supervisor = asyncio.create_task(supervise())
    gc.collect()  # start-up's objects (the tokenizer's, the app's) out of the collector's full passes, as engines do
    gc.freeze()
    logger.info(
        "serving %s with %d engine(s) at http://%s:%d", state.model_name, len(group.clients), config.server.host,
        config.server.port,
    )  # fmt: skip
    try:
        await server.serve()
    finally:
        supervisor.cancel()
        await asyncio.gather(supervisor, return_exceptions=True)
        await group.close()
    if shutdown.forced_by is not None:
        return 128 + shutdown.forced_by
    if failure is not None:
        logger.error("exiting with status 1: %s", failure)
        return 1
    logger.info("stopped")
    return 0


async def _drain(state: ServerState, timeout: float, shutdown: _Shutdown) -> None:
    """Refuse new requests (503) and wait up to ``timeout`` s for those in flight; fail the rest with 503."""
    state.is_draining = True
    group = state.group
    if group.num_in_flight:
        logger.info("draining %d request(s) for up to %.0f s", group.num_in_flight, timeout)
    deadline = asyncio.get_running_loop().time() + timeout
    while group.num_in_flight and shutdown.forced_by is None and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(_POLL_INTERVAL_S)
    if group.num_in_flight:
        logger.warning("server.drain_timeout (%.0f s) passed; failing %d request(s)", timeout, group.num_in_flight)
        group.fail_requests(f"the server is shutting down: server.drain_timeout ({timeout:.0f} s) passed")
