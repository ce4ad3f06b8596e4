"""`tokenmill serve`: start (or connect to) the engines, then serve HTTP until told to stop.

With ``server.disaggregated_prefill`` the engines are a prefill engine and a
decode engine joined by a ZeroMQ KV connector (``DisaggregatedGroup``).

Shutdown: on SIGTERM or Ctrl-C uvicorn stops accepting connections and lets
running requests finish for up to ``server.drain_timeout`` seconds, then the
engines are stopped. If an engine dies, its in-flight requests fail at once
with 503 (the client's watchdog sees the process exit or the heartbeats stop),
``/health`` turns 503, and a second later the server exits with status 1 so a
supervisor (systemd, Kubernetes) restarts the whole service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import uvicorn

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.config.cache import KVTierConfig
from tokenmill.engine_client import DisaggregatedGroup, EngineClient, EngineGroup, start_local_engines
from tokenmill.model_files import DEFAULT_MODEL, resolve_tokenizer
from tokenmill.plugin_manager import Slot, resolve_plugins
from tokenmill.server.app import ServerState, build_app
from tokenmill.server.metrics import ServerMetrics
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ENGINE_START_TIMEOUT_S = 600.0
_EXIT_GRACE_S = 1.0


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would die by
    the signal; a drained, orderly shutdown should exit 0 instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def served_model_name(config: EngineConfig) -> str:
    if config.server.served_model_name:
        return config.server.served_model_name
    model = config.model.model
    return model if model == DEFAULT_MODEL.name else Path(model).name


def disaggregated_configs(config: EngineConfig) -> tuple[EngineConfig, EngineConfig]:
    """The prefill and the decode engine's configs: each the server's, plus the two ends of a KV connector
    (``zmq-push`` on the prefill engine, ``zmq-pull`` on the decode engine) over a fresh ipc:// address."""
    if config.server.engines or config.server.data_parallel_size > 1:
        raise ConfigError("server.disaggregated_prefill starts its own two engines: it cannot be combined with "
                          "server.engines or data_parallel_size > 1")  # fmt: skip
    if not config.cache.enable_prefix_caching:
        raise ConfigError("server.disaggregated_prefill needs cache.enable_prefix_caching: the decode engine "
                          "finds the shipped blocks through its prefix cache")  # fmt: skip
    address = f"ipc://{os.path.join(tempfile.mkdtemp(prefix='tokenmill-kv-'), 'kv-transfer.sock')}"
    buffer = config.server.kv_transfer_buffer
    push = KVTierConfig("zmq-push", buffer, address)
    pull = KVTierConfig("zmq-pull", buffer, address)
    return (
        msgspec.structs.replace(config, kv_tiers=[*config.kv_tiers, push]),
        msgspec.structs.replace(config, kv_tiers=[*config.kv_tiers, pull]),
    )


def run_server(config: EngineConfig) -> int:
    """Serve until stopped; returns the process exit status (1 when an engine died)."""
    return asyncio.run(_serve(config))


async def _serve(config: EngineConfig) -> int:
    # Every plugin name and option is checked here, before any engine starts or model loads, so a
    # misspelled router or transport fails at once with one line.
    plugins = resolve_plugins(config)
    transport = plugins.create(Slot.TRANSPORT, config.transport.backend)
    router = plugins.create(Slot.ROUTER, config.server.router)
    router_plugin = plugins.registry.get(Slot.ROUTER, config.server.router).plugin
    group: EngineGroup
    if config.server.disaggregated_prefill:
        prefill, decode = start_local_engines(config, 2, transport, disaggregated_configs(config))
        clients = [prefill, decode]
        group = DisaggregatedGroup(prefill, decode, router)
    elif config.server.engines:
        clients = [
            EngineClient(address, transport, index, None, config.server.engine_timeout)
            for index, address in enumerate(config.server.engines)
        ]
        group = EngineGroup(clients, router, config.server.router, router_plugin)
    else:
        clients = start_local_engines(config, config.server.data_parallel_size, transport)
        group = EngineGroup(clients, router, config.server.router, router_plugin)
    try:
        await asyncio.gather(*(client.start(ENGINE_START_TIMEOUT_S) for client in clients))
        tokenizer = await asyncio.to_thread(
            Tokenizer.from_path, resolve_tokenizer(config.model.model, config.model.tokenizer)
        )
    except BaseException:
        await group.close()
        raise
    name = served_model_name(config)
    state = ServerState(config, group, tokenizer, name, ServerMetrics(group, name))
    server = _Server(
        uvicorn.Config(
            build_app(state),
            host=config.server.host,
            port=config.server.port,
            log_level="warning",
            timeout_graceful_shutdown=int(config.server.drain_timeout),
        )
    )
    exit_status = 0

    async def watch_engines() -> None:
        nonlocal exit_status
        while not server.should_exit:
            await asyncio.sleep(0.2)
            if not group.is_healthy:
                await asyncio.sleep(_EXIT_GRACE_S)  # let in-flight requests receive their 503
                exit_status = 1
                server.should_exit = True
        state.is_draining = True

    watcher = asyncio.create_task(watch_engines())
    logger.info(
        "serving %s with %d engine(s) at http://%s:%d", name, len(clients), config.server.host, config.server.port
    )
    try:
        await server.serve()
    finally:
        watcher.cancel()
        await group.close()
    if exit_status:
        logger.error("an engine died; exiting with status %d", exit_status)
    return exit_status
