"""The front end's side of the engines: engine clients, local engine processes, routing.

Each ``EngineClient`` talks to one engine over a connection of the configured
``Transport``. A receive task routes every ``EngineCoreOutput`` to the queue of
the request it belongs to; a watchdog marks the engine dead when its process
exits or its heartbeats stop, and then fails every request still waiting on it
with ``EngineDeadError``, so no caller hangs. ``EngineGroup`` asks a ``Router``
plugin which engine serves each request; a router that fails fails only that
request, with ``RouterError``. Runs in the asyncio front end; imports no torch.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.errors import TokenmillError
from tokenmill.kv_cache.block_hash import block_hashes
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
from tokenmill.routing import EngineState, Router
from tokenmill.sampling_params import SamplingParams
from tokenmill.transport.base import FrontendConnection, Transport
from tokenmill.transport.serde import decode_from_engine, encode

logger = logging.getLogger(__name__)

_WATCHDOG_INTERVAL_S = 0.2


class EngineDeadError(TokenmillError):
    """The engine serving a request stopped answering (its process died or its heartbeats stopped)."""


class RouterError(TokenmillError):
    """The router plugin raised, or picked something that is not a healthy engine, for one request."""


@dataclass
class RequestStream:
    """Where one request's outputs arrive, in order; an ``EngineDeadError`` ends it early."""

    request_id: str
    queue: asyncio.Queue[EngineCoreOutput | EngineDeadError]
    client: EngineClient


class EngineClient:
    def __init__(
        self, address: str, transport: Transport, index: int = 0, process: Any = None, heartbeat_timeout: float = 5.0
    ) -> None:
        self.address = address
        self.transport = transport
        self.index = index
        self.process = process  # a multiprocessing.Process for a local engine, else None
        self.heartbeat_timeout = heartbeat_timeout
        self.ready: Ready | None = None
        self.stats: EngineStatsMessage | None = None
        self.is_dead = False
        self.death_reason = ""
        self._streams: dict[str, RequestStream] = {}
        self._connection: FrontendConnection | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_seen = 0.0

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def start(self, timeout: float) -> Ready:
        """Connect, handshake, and start receiving. Raises ``EngineDeadError`` if no engine answers in time."""
        connection = self.transport.connect(self.address)
        self._connection = connection
        connection.send(encode(Hello(PROTOCOL_VERSION)))
        deadline = time.monotonic() + timeout
        while self.ready is None:
            if self.process is not None and not self.process.is_alive():
                code = self.process.exitcode
                raise EngineDeadError(f"engine at {self.address} exited with code {code} while starting")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineDeadError(f"no engine answered at {self.address} within {timeout:.0f} s")
            if await connection.poll(min(remaining, 0.5)):
                message = decode_from_engine(await connection.recv())
                if isinstance(message, Ready):
                    if message.error:
                        raise EngineDeadError(f"engine at {self.address} refused the handshake: {message.error}")
                    self.ready = message
        self._last_seen = time.monotonic()
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watchdog())]
        return self.ready

    def add_request(self, request: EngineCoreRequest) -> RequestStream:
        stream = self.open_stream(request.request_id)
        self.submit(request)
        return stream

    def open_stream(self, request_id: str) -> RequestStream:
        """The queue a request's outputs will arrive on (and an ``EngineDeadError`` if this engine dies),
        registered before the request is sent (``submit``)."""
        if self.is_dead:
            raise EngineDeadError(f"engine at {self.address} is down: {self.death_reason}")
        stream = RequestStream(request_id, asyncio.Queue(), self)
        self._streams[request_id] = stream
        return stream

    def has_stream(self, request_id: str) -> bool:
        """Whether the request's stream is open (not finished, aborted or failed)."""
        return request_id in self._streams

    def submit(self, request: EngineCoreRequest) -> None:
        if self.is_dead:
            raise EngineDeadError(f"engine at {self.address} is down: {self.death_reason}")
        assert self._connection is not None
        self._connection.send(encode(request))

    def abort(self, request_ids: list[str], completions_only: bool = False) -> None:
        """Abort whole requests (every completion; their streams end here), or with ``completions_only``
        single completions whose stop string matched (the request's stream stays for its other completions)."""
        if not completions_only:
            for request_id in request_ids:
                self._streams.pop(request_id, None)
        if request_ids and not self.is_dead and self._connection is not None:
            self._connection.send(encode(AbortRequests(request_ids, completions_only)))

    def release(self, request_id: str) -> None:
        """Forget a finished request's queue."""
        self._streams.pop(request_id, None)

    async def _receive(self) -> None:
        assert self._connection is not None
        while True:
            message = decode_from_engine(await self._connection.recv())
            self._last_seen = time.monotonic()
            if not isinstance(message, EngineCoreOutputs):
                continue
            self.stats = message.stats
            for output in message.outputs:
                stream = self._streams.get(output.parent_id or output.request_id)
                if stream is not None:
                    stream.queue.put_nowait(output)

    async def _watchdog(self) -> None:
        while not self.is_dead:
            await asyncio.sleep(_WATCHDOG_INTERVAL_S)
            if self.process is not None and not self.process.is_alive():
                self._die(f"engine process exited with code {self.process.exitcode}")
            elif time.monotonic() - self._last_seen > self.heartbeat_timeout:
                self._die(f"no heartbeat for {self.heartbeat_timeout:.0f} s")

    def _die(self, reason: str) -> None:
        self.is_dead = True
        self.death_reason = reason
        logger.error("engine %d at %s is down: %s", self.index, self.address, reason)
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(f"the engine serving this request is down: {reason}"))
        self._streams.clear()

    def state(self) -> EngineState:
        stats = self.stats
        return EngineState(
            index=self.index,
            is_healthy=not self.is_dead,
            num_running=stats.num_running if stats else 0,
            num_waiting=stats.num_waiting if stats else 0,
            kv_cache_usage=stats.kv_cache_usage if stats else 0.0,
            num_in_flight=self.num_in_flight,
        )

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._connection is not None:
            self._connection.close()
        if self.process is not None and self.process.is_alive():
            self.process.terminate()
            await asyncio.to_thread(self.process.join, 10)
            if self.process.is_alive():
                self.process.kill()


class EngineGroup:
    """Every engine the front end serves from, and the router that picks one per request.

    :param router_name: the name the config selected the router by, and ``plugin_name`` the plugin that
        registered it; a ``RouterError`` names both, so the user knows which plugin to fix or unselect.
    """

    def __init__(
        self, clients: list[EngineClient], router: Router, router_name: str | None = None, plugin_name: str = "unknown"
    ) -> None:
        assert all(client.index == position for position, client in enumerate(clients)), "index is the position"
        self.clients = clients
        self.router = router
        name = router_name or getattr(router, "name", type(router).__name__)
        self.router_label = f"router {name!r} (plugin {plugin_name!r})"

    @property
    def is_healthy(self) -> bool:
        return all(not client.is_dead for client in self.clients)

    @property
    def max_model_len(self) -> int:
        return min(client.ready.max_model_len for client in self.clients if client.ready)

    @property
    def max_num_seqs(self) -> int:
        return sum(client.ready.max_num_seqs for client in self.clients if client.ready)

    @property
    def num_in_flight(self) -> int:
        return sum(client.num_in_flight for client in self.clients)

    def add_request(self, request: EngineCoreRequest) -> RequestStream:
        """Send ``request`` to the engine the router picks.

        Raises ``EngineDeadError`` when no engine is up, and ``RouterError`` when the router raises or
        picks an engine that is not a healthy one; either way nothing was sent.
        """
        states = [client.state() for client in self.clients]
        if not any(state.is_healthy for state in states):
            reasons = "; ".join(c.death_reason for c in self.clients)
            raise EngineDeadError(f"no engine is available: {reasons}")
        prefix_hashes = self._prefix_hashes(request) if self.router.needs_prefix_hashes else ()
        try:
            index = self.router.select(request, states, prefix_hashes)
        except Exception as exc:  # a broken router fails this request, not the server
            logger.error("%s failed for request %s", self.router_label, request.request_id, exc_info=exc)
            raise RouterError(f"{self.router_label} failed: {type(exc).__name__}: {exc}") from exc
        is_engine = isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(states)
        if not is_engine or not states[index].is_healthy:
            healthy = [state.index for state in states if state.is_healthy]
            message = f"{self.router_label} failed: returned {index!r}, not a healthy engine (healthy: {healthy})"
            logger.error("%s", message)
            raise RouterError(message)
        return self.clients[index].add_request(request)

    def _prefix_hashes(self, request: EngineCoreRequest) -> Sequence[bytes]:
        """The prompt's block hashes as the engines' prefix caches compute them (all engines serve the same
        model, so the first one's block size and salt stand for all)."""
        ready = next((client.ready for client in self.clients if client.ready is not None), None)
        if ready is None:
            return ()
        return block_hashes(request.prompt_token_ids, ready.block_size, ready.hash_salt, request.cache_salt)

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self.clients))


class DisaggregatedGroup(EngineGroup):
    """A prefill engine (client 0) and a decode engine (client 1) serving as one.

    Each request goes to the prefill engine first, as a one-token request whose finished blocks the prefill
    engine's ``zmq-push`` tier ships to the decode engine; then the request itself goes to the decode engine
    (``kv_transfer_params``: ``do_remote_prefill``), which waits for those blocks, loads them instead of
    computing the prompt, and streams the completion. The request's stream is the decode engine's from the
    start, so an abort or the decode engine's death reaches it at any point. If the prefill engine is down or
    refuses the request, the decode engine computes the prompt itself: slower, same output.
    """

    def __init__(self, prefill: EngineClient, decode: EngineClient, router: Router) -> None:
        super().__init__([prefill, decode], router, "disaggregated-prefill", "tokenmill")
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def max_num_seqs(self) -> int:
        return self.clients[1].ready.max_num_seqs if self.clients[1].ready else 0

    @property
    def num_in_flight(self) -> int:
        return self.clients[1].num_in_flight  # every request holds a decode stream from the start

    def add_request(self, request: EngineCoreRequest) -> RequestStream:
        stream = self.clients[1].open_stream(request.request_id)
        task = asyncio.create_task(self._run(request, stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return stream

    async def _run(self, request: EngineCoreRequest, stream: RequestStream) -> None:
        try:
            await self._prefill_then_decode(request)
        except Exception as exc:  # a bug here must fail this request, never leave its client waiting
            logger.exception("disaggregated request %s failed", request.request_id)
            stream.queue.put_nowait(EngineDeadError(f"the request failed between prefill and decode: {exc}"))

    async def _prefill_then_decode(self, request: EngineCoreRequest) -> None:
        prefill, decode = self.clients
        prefill_request = msgspec.structs.replace(
            request, params=SamplingParams(max_tokens=1, temperature=0.0), kv_transfer_params={"do_remote_decode": True}
        )
        remote = False
        try:
            prefill_stream = prefill.add_request(prefill_request)
            while True:
                item = await prefill_stream.queue.get()
                if isinstance(item, EngineDeadError) or item.error is not None:
                    reason = item if isinstance(item, EngineDeadError) else item.error
                    logger.warning("prefill of %s failed (%s); decoding computes it", request.request_id, reason)
                    break
                if item.request_finished:
                    remote = True
                    break
        except EngineDeadError:
            pass
        finally:
            prefill.release(request.request_id)
        if not decode.has_stream(request.request_id):  # aborted (client gone) or failed meanwhile
            return
        params = {"do_remote_prefill": True} if remote else None
        try:
            decode.submit(msgspec.structs.replace(request, kv_transfer_params=params))
        except EngineDeadError:
            pass  # the decode engine's watchdog fails the stream


def start_local_engines(
    config: EngineConfig, count: int, transport: Transport, configs: Sequence[EngineConfig] = ()
) -> list[EngineClient]:
    """Start ``count`` engine processes on ipc:// addresses (engine i with ``configs[i]`` when given, else
    ``config``); returns their (unstarted) clients.

    Processes are spawned, not forked: the child starts a fresh interpreter, so
    the front end never imports torch and never shares state with the engine.
    Each engine builds its own instance of the transport ``config`` selects;
    ``transport`` is this process's instance of it.
    """
    from tokenmill.engine_process import run_engine_process

    context = multiprocessing.get_context("spawn")
    socket_dir = tempfile.mkdtemp(prefix="tokenmill-")
    clients = []
    for index in range(count):
        address = f"ipc://{os.path.join(socket_dir, f'engine-{index}.sock')}"
        engine_config = configs[index] if configs else config
        process = context.Process(
            target=run_engine_process,
            args=(engine_config.to_dict(), address, True),
            name=f"tokenmill-engine-{index}",
            daemon=True,
        )
        process.start()
        clients.append(EngineClient(address, transport, index, process, config.server.engine_timeout))
    return clients
