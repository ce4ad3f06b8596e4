"""The front end's side of the engines: engine clients, local engine processes, routing.

Each ``EngineClient`` talks to one engine over a connection of the configured
``Transport``. A receive task routes every ``EngineCoreOutput`` to the queue of
the request it belongs to; a supervisor task marks the engine dead when its
process exits or its heartbeats stop, fails every request still waiting on it
with ``EngineDeadError``, so no caller hangs, and brings the engine back:
restarts an engine process this front end started, reconnects to a remote one,
with backoff and a bounded number of failed attempts in a row (local engine
processes are started and stopped by ``tokenmill.engine_launcher``). An
``EngineGroup`` is every engine the front end serves from: a
``RoutedEngineGroup`` asks a ``Router`` plugin which engine serves each
request, among those that are up (when the router fails, that request goes to
the least loaded engine instead and the fallback is counted); a
``DisaggregatedGroup`` sends each request through a prefill engine, then a
decode engine. Each client keeps the engine's latest stats and a mirror of its
prefix cache (``tokenmill.prefix_summary``) for the routers. Runs in the
asyncio front end; imports no torch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.engine_launcher import LocalEngineProcess
from tokenmill.errors import TokenmillError
from tokenmill.kv_cache.block_hash import block_hashes
from tokenmill.lora.request import lora_cache_salt
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
from tokenmill.prefix_summary import PrefixCacheSummary, prefix_keys
from tokenmill.routing import EngineState, Router, least_loaded
from tokenmill.sampling_params import SamplingParams
from tokenmill.transport.base import FrontendConnection, Transport, TransportSecurity
from tokenmill.transport.serde import decode_from_engine, encode

logger = logging.getLogger(__name__)

_WATCHDOG_INTERVAL_S = 0.2
_RESTART_BACKOFF_S = 1.0  # before the first restart attempt; doubled after each failed one
_MAX_RESTART_BACKOFF_S = 30.0
_STABLE_AFTER_S = 60.0  # an engine up this long has served, even if no request finished
_STOP_TIMEOUT_S = 10.0  # for an engine to exit on SIGTERM (it flushes its KV tiers) before it is killed


class EngineDeadError(TokenmillError):
    """The engine serving a request stopped answering (its process died or its heartbeats stopped)."""


class EngineProcess(Protocol):
    """An engine the front end started and brings back after it dies: a ``LocalEngineProcess`` on this host, or
    a replica an engine backend placed (``tokenmill.engine_backend``; the Ray backend's is
    ``tokenmill_plugins.ray_backend.replicas.RayEngineReplica``). Called from the front end's event
    loop; nothing here blocks for long."""

    @property
    def exit_reason(self) -> str:
        """Once ``is_alive`` is false: how it ended, as the end of a sentence (``was killed by SIGKILL``)."""
        ...

    def is_alive(self) -> bool:
        """Whether the engine runs (called every watchdog tick)."""
        ...

    async def locate(self, timeout: float) -> tuple[str, TransportSecurity | None]:
        """Where the engine serves, once started (a restarted one may move), and the keys to connect to it with
        (None: the client's own). Raises ``EngineDeadError`` if that is not known within ``timeout`` s."""
        ...

    async def restart(self) -> None:
        """Start it again after it died (or was killed); ``locate`` then finds the new one."""
        ...

    def kill(self) -> None:
        """Kill it now, with whatever it started (a hung engine); ``restart`` brings it back."""
        ...

    async def stop(self, timeout: float) -> None:
        """Stop it for good: up to ``timeout`` s to finish its step and flush, then killed."""
        ...


@dataclass
class RequestStream:
    """Where one request's outputs arrive, in order; an ``EngineDeadError`` ends it early."""

    request_id: str
    queue: asyncio.Queue[EngineCoreOutput | EngineDeadError]
    client: EngineClient
    #: The request's LoRA adapter, once it is sent (``EngineClient.submit``); None for the base model.
    lora_name: str | None = None


class EngineClient:
    """The front end's connection to one engine, and its supervisor.

    A watchdog notices when the engine's process exits or its heartbeats stop for ``heartbeat_timeout``
    seconds; every request waiting on it then fails with ``EngineDeadError`` and the client is down
    (``is_dead``: routers see it unhealthy) while it recovers. An engine this front end started (``process``)
    is killed with everything it started and started again; a remote one (``process`` None) cannot be, so it is
    connected to again (whoever runs it restarts it). Attempts wait 1, 2, 4, ... s (at most 30) after each
    failure; after ``max_restarts`` failed attempts in a row the client gives up and sets ``failure``, a line
    saying why (the server then exits). An attempt fails when the engine does not answer the handshake, or
    answers and dies again before it has served: finished a request or stayed up for a minute.

    :param process: the ``EngineProcess`` of an engine this front end started, else None.
    :param max_restarts: failed restarts in a row allowed; 0 gives up at the first death.
    :param security: this front end's keys for the transport (``tokenmill.transport.security``), or None.
    """

    def __init__(
        self,
        address: str,
        transport: Transport,
        index: int = 0,
        process: EngineProcess | None = None,
        heartbeat_timeout: float = 5.0,
        max_restarts: int = 0,
        security: TransportSecurity | None = None,
    ) -> None:
        self.address = address
        self.transport = transport
        self.security = security  # given to connect (CURVE keys for tcp:// engines), for transports that take it
        self.index = index
        self.process = process
        self.heartbeat_timeout = heartbeat_timeout
        self.max_restarts = max_restarts
        self.ready: Ready | None = None
        self.stats: EngineStatsMessage | None = None
        #: What the engine's prefix cache holds, from its stats messages (for prefix-aware routers).
        self.prefix_cache = PrefixCacheSummary()
        self.is_dead = False
        self.death_reason = ""
        #: Times the engine came back (restarted, or reconnected to) after it died.
        self.num_restarts = 0
        #: Set when the client gave up restarting the engine: one line saying why.
        self.failure: str | None = None
        self._streams: dict[str, RequestStream] = {}
        self._connection: FrontendConnection | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._start_timeout = 0.0
        self._last_seen = 0.0
        self._ready_at = 0.0
        self._has_served = False  # since it last answered the handshake: finished a request
        self._is_restarted = False  # the current engine comes from a restart (its early death is a failed one)
        self._num_failed_restarts = 0  # in a row
        self._orphaned_ids: list[str] = []  # requests a remote engine may still be running for nobody
        # Estimated tokens of the requests sent since the engine's last stats message (not in its counts yet).
        self._num_unreported_tokens = 0
        # Requests in flight here by LoRA adapter (``lora_name``): the engine holds those adapters (routers).
        self._num_in_flight_by_lora: dict[str, int] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def status(self) -> str:
        """``up``, ``down`` (while it restarts) or ``failed`` (it will not come back)."""
        return "failed" if self.failure is not None else "down" if self.is_dead else "up"

    async def start(self, timeout: float) -> Ready:
        """Connect, handshake, start receiving and supervising. Raises ``EngineDeadError`` if no engine answers
        in ``timeout`` seconds (a restart of a local engine gets as long; a reconnection, ``heartbeat_timeout``)."""
        self._start_timeout = timeout
        await self._handshake(timeout)
        self._supervisor = asyncio.create_task(self._supervise())
        assert self.ready is not None
        return self.ready

    async def _handshake(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if self.process is not None:  # a Ray replica serves where its current actor bound, with its own keys
            self.address, security = await self.process.locate(timeout)
            self.security = security or self.security
        if self.security is not None and self.transport.supports_security:
            connection = self.transport.connect(self.address, security=self.security)
        else:
            connection = self.transport.connect(self.address)
        self._connection = connection
        try:
            connection.send(encode(Hello(PROTOCOL_VERSION)))
            while True:
                if self.process is not None and not self.process.is_alive():
                    raise EngineDeadError(f"engine at {self.address} {self.process.exit_reason} while starting")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineDeadError(f"no engine answered at {self.address} within {timeout:.0f} s")
                if (refusal := connection.handshake_failure()) is not None:
                    raise EngineDeadError(f"engine at {self.address} refused the connection: {refusal}")
                if await connection.poll(min(remaining, 0.5)):
                    message = decode_from_engine(await connection.recv())
                    if isinstance(message, Ready):
                        if message.error:
                            raise EngineDeadError(f"engine at {self.address} refused the handshake: {message.error}")
                        self.ready = message
                        break
        except BaseException:
            connection.close()
            self._connection = None
            raise
        self._last_seen = self._ready_at = time.monotonic()
        self._has_served = False
        self.prefix_cache.clear()  # a restarted engine's cache starts empty; a snapshot follows the Hello
        self._num_unreported_tokens = 0
        self._receiver = asyncio.create_task(self._receive(connection))

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

    def submit(self, request: EngineCoreRequest, num_cached_tokens: int = 0) -> None:
        """Send ``request``; ``num_cached_tokens`` of its prompt are expected to be in the engine's prefix cache
        (for the load estimate until the engine counts the request)."""
        if self.is_dead:
            raise EngineDeadError(f"engine at {self.address} is down: {self.death_reason}")
        assert self._connection is not None
        self._connection.send(encode(request))
        num_prompt = len(request.prompt_token_ids)
        max_tokens = request.params.max_tokens
        if max_tokens is None:
            max_tokens = max(0, self.ready.max_model_len - num_prompt) if self.ready is not None else 0
        self._num_unreported_tokens += max(0, num_prompt - num_cached_tokens) + max_tokens * request.params.n
        stream = self._streams.get(request.request_id)
        if request.lora_request is not None and stream is not None and stream.lora_name is None:
            stream.lora_name = name = request.lora_request.lora_name
            self._num_in_flight_by_lora[name] = self._num_in_flight_by_lora.get(name, 0) + 1

    def abort(self, request_ids: list[str], completions_only: bool = False) -> None:
        """Abort whole requests (every completion; their streams end here), or with ``completions_only``
        single completions whose stop string matched (the request's stream stays for its other completions)."""
        if not completions_only:
            for request_id in request_ids:
                self._close_stream(request_id)
        if request_ids and not self.is_dead and self._connection is not None:
            self._connection.send(encode(AbortRequests(request_ids, completions_only)))

    def release(self, request_id: str) -> None:
        """Forget a finished request's queue."""
        self._close_stream(request_id)

    def _close_stream(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream.lora_name is not None:
            count = self._num_in_flight_by_lora[stream.lora_name] - 1
            if count:
                self._num_in_flight_by_lora[stream.lora_name] = count
            else:
                del self._num_in_flight_by_lora[stream.lora_name]

    def fail_requests(self, reason: str) -> None:
        """End every request in flight here with ``EngineDeadError(reason)`` and abort them in the engine (the
        server stops waiting for them: its drain timed out)."""
        request_ids = self._fail_streams(reason)
        self.abort(request_ids)

    async def _receive(self, connection: FrontendConnection) -> None:
        while True:
            message = decode_from_engine(await connection.recv())
            self._last_seen = time.monotonic()
            if not isinstance(message, EngineCoreOutputs):
                continue
            self.stats = message.stats
            self._num_unreported_tokens = 0
            if not self.prefix_cache.apply(message.stats):  # a message was lost: ask for a snapshot
                connection.send(encode(Hello(PROTOCOL_VERSION)))
            for output in message.outputs:
                if output.request_finished:
                    self._has_served = True
                stream = self._streams.get(output.parent_id or output.request_id)
                if stream is not None:
                    stream.queue.put_nowait(output)

    async def _supervise(self) -> None:
        while True:
            self._die(await self._watch())
            if not await self._recover():
                return

    async def _watch(self) -> str:
        """Wait until the engine dies; returns why."""
        while True:
            await asyncio.sleep(_WATCHDOG_INTERVAL_S)
            if self.is_dead:
                continue  # marked down from outside; nothing to watch
            if self.process is not None and not self.process.is_alive():
                return f"engine process {self.process.exit_reason}"
            if time.monotonic() - self._last_seen > self.heartbeat_timeout:
                return f"no heartbeat for {self.heartbeat_timeout:.0f} s"

    def _die(self, reason: str) -> None:
        self.is_dead = True
        self.death_reason = reason
        if self._has_served or time.monotonic() - self._ready_at >= _STABLE_AFTER_S:
            self._num_failed_restarts = 0
        elif self._is_restarted:
            self._num_failed_restarts += 1  # the restart that brought it up did not hold
        logger.error("engine %d at %s is down: %s", self.index, self.address, reason)
        request_ids = self._fail_streams(f"the engine serving this request is down: {reason}")
        if self._receiver is not None:
            self._receiver.cancel()
        if self.process is not None:
            self.process.kill()  # a hung engine goes now, with every process it started
        elif request_ids:
            self._orphaned_ids = request_ids  # a remote engine that was only slow may still run them
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _fail_streams(self, reason: str) -> list[str]:
        request_ids = list(self._streams)
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(reason))
        self._streams.clear()
        self._num_in_flight_by_lora.clear()
        return request_ids

    async def _recover(self) -> bool:
        """Restart (local) or reconnect to (remote) the engine until it answers; False when giving up."""
        verb = "restart" if self.process is not None else "reconnect to"
        last_error = self.death_reason
        while self._num_failed_restarts < self.max_restarts:
            attempt = self._num_failed_restarts + 1
            delay = min(_RESTART_BACKOFF_S * 2**self._num_failed_restarts, _MAX_RESTART_BACKOFF_S)
            logger.warning("will %s engine %d in %.0f s (attempt %d of %d)", verb, self.index, delay, attempt,
                           self.max_restarts)  # fmt: skip
            await asyncio.sleep(delay)
            started = time.monotonic()
            try:
                if self.process is not None:
                    await self.process.restart()  # killed already: a fresh one (Ray restarts its actor itself)
                    await self._handshake(self._start_timeout)
                else:
                    await self._handshake(min(self._start_timeout, self.heartbeat_timeout))
            except (EngineDeadError, TokenmillError, OSError) as exc:
                self._num_failed_restarts += 1
                last_error = str(exc)
                logger.error("engine %d: %s attempt %d failed: %s", self.index, verb.split()[0], attempt, exc)
                if self.process is not None:
                    self.process.kill()  # one that did not answer in time must not load on beside the next
                continue
            self.num_restarts += 1
            self._is_restarted = True
            self.is_dead = False
            self.death_reason = ""
            if self._orphaned_ids and self._connection is not None:
                self._connection.send(encode(AbortRequests(self._orphaned_ids)))
            self._orphaned_ids = []
            logger.warning("engine %d at %s is up again after %.1f s of loading (restart %d)", self.index,
                           self.address, time.monotonic() - started, self.num_restarts)  # fmt: skip
            return True
        if self.max_restarts == 0:
            self.failure = f"engine {self.index} died ({self.death_reason}) and server.max_engine_restarts is 0"
        else:
            self.failure = (
                f"engine {self.index} could not be {'restarted' if self.process else 'reconnected to'}: "
                f"{self.max_restarts} attempts in a row failed (last: {last_error})"
            )
        logger.error("%s", self.failure)
        return False

    def state(self, prefix_keys: Sequence[bytes] = ()) -> EngineState:
        """What routers see of this engine; ``prefix_keys`` (a prompt's, ``tokenmill.prefix_summary``) fill in
        ``num_cached_prefix_tokens``."""
        stats = self.stats
        unreported = self._num_unreported_tokens
        block_size = self.ready.block_size if self.ready is not None else 0
        num_free_kv_tokens = stats.num_free_kv_blocks * block_size if stats else 0
        num_cached_blocks = self.prefix_cache.num_matching_blocks(prefix_keys) if prefix_keys else 0
        lora_adapters = frozenset(self._num_in_flight_by_lora)
        if stats is not None and (stats.running_lora_adapters or stats.waiting_lora_adapters):
            lora_adapters = lora_adapters.union(stats.running_lora_adapters, stats.waiting_lora_adapters)
        return EngineState(
            index=self.index,
            is_healthy=not self.is_dead,
            num_running=stats.num_running if stats else 0,
            num_waiting=stats.num_waiting if stats else 0,
            kv_cache_usage=stats.kv_cache_usage if stats else 0.0,
            num_in_flight=self.num_in_flight,
            num_outstanding_tokens=(stats.num_outstanding_tokens if stats else 0) + unreported,
            num_free_kv_tokens=max(0, num_free_kv_tokens - unreported),
            num_cached_prefix_tokens=num_cached_blocks * block_size,
            lora_adapters=lora_adapters,
            max_loras=stats.max_loras if stats else 0,
        )

    def kill(self) -> None:
        """Kill the engine process (if this front end started it) with every process it started, now."""
        if self.process is not None:
            self.process.kill()

    async def close(self) -> None:
        """Stop supervising; stop the engine process (if this front end started it) and wait for it."""
        tasks = [task for task in (self._supervisor, self._receiver) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        if self.process is not None:
            await self.process.stop(_STOP_TIMEOUT_S)


class EngineGroup(ABC):
    """Every engine the front end serves from; subclasses decide which engine serves a request."""

    def __init__(self, clients: list[EngineClient]) -> None:
        assert all(client.index == position for position, client in enumerate(clients)), "index is the position"
        self.clients = clients

    @property
    def is_healthy(self) -> bool:
        """Whether every engine is up."""
        return all(not client.is_dead for client in self.clients)

    @property
    def is_serving(self) -> bool:
        """Whether a new request can be served: some engine is up (requests go to those that are)."""
        return any(not client.is_dead for client in self.clients)

    @property
    def max_model_len(self) -> int:
        return min(client.ready.max_model_len for client in self.clients if client.ready)

    @property
    def max_num_seqs(self) -> int:
        """Requests the engines that are up run at once."""
        return sum(client.ready.max_num_seqs for client in self.clients if client.ready and not client.is_dead)

    @property
    def num_in_flight(self) -> int:
        return sum(client.num_in_flight for client in self.clients)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> RequestStream:
        """Send ``request`` to an engine; its outputs arrive on the stream returned. Raises ``EngineDeadError``
        when no engine can take it; then nothing was sent."""

    def fail_requests(self, reason: str) -> None:
        """End every request in flight with ``EngineDeadError(reason)`` and abort them in the engines."""
        for client in self.clients:
            client.fail_requests(reason)

    def kill(self) -> None:
        """Kill every engine process this front end started, now (``close`` still reaps them)."""
        for client in self.clients:
            client.kill()

    async def close(self) -> None:
        """Stop supervising and stop the engines this front end started (in parallel)."""
        await asyncio.gather(*(client.close() for client in self.clients))


class RoutedEngineGroup(EngineGroup):
    """Engines serving the same model, and the router that picks one per request.

    When the router raises or picks something that is not a healthy engine, the request goes to the engine
    ``least_loaded`` picks; ``num_router_fallbacks`` counts those by reason (``error``, ``invalid_choice``).

    :param router_name: the name the config selected the router by, and ``plugin_name`` the plugin that
        registered it; the fallback's log line names both, so the user knows which plugin to fix or unselect.
    """

    def __init__(
        self, clients: list[EngineClient], router: Router, router_name: str | None = None, plugin_name: str = "unknown"
    ) -> None:
        super().__init__(clients)
        self.router = router
        self.router_name = str(router_name or getattr(router, "name", type(router).__name__))
        self.router_label = f"router {self.router_name!r} (plugin {plugin_name!r})"
        #: Requests routed by ``least_loaded`` because the router failed, by reason.
        self.num_router_fallbacks: dict[str, int] = {"error": 0, "invalid_choice": 0}

    def add_request(self, request: EngineCoreRequest) -> RequestStream:
        """Send ``request`` to the engine the router picks (``least_loaded``'s pick when the router fails).

        Raises ``EngineDeadError`` when no engine is up; then nothing was sent.
        """
        prefix_hashes = self._prefix_hashes(request) if self.router.needs_prefix_hashes else ()
        keys = prefix_keys(prefix_hashes)
        states = [client.state(keys) for client in self.clients]
        if not any(state.is_healthy for state in states):
            reasons = "; ".join(c.death_reason for c in self.clients)
            raise EngineDeadError(f"no engine is available: {reasons}")
        try:
            index = self.router.select(request, states, prefix_hashes)
        except Exception as exc:  # a broken router must not fail the request, nor the server
            index = self._fall_back(states, "error", f"{type(exc).__name__}: {exc}", request.request_id, exc)
        else:
            is_engine = isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(states)
            if not is_engine or not states[index].is_healthy:
                healthy = [state.index for state in states if state.is_healthy]
                why = f"returned {index!r}, not a healthy engine (healthy: {healthy})"
                index = self._fall_back(states, "invalid_choice", why, request.request_id)
        client = self.clients[index]
        stream = client.open_stream(request.request_id)
        client.submit(request, states[index].num_cached_prefix_tokens)
        client.prefix_cache.note_routed(keys)
        return stream

    def _fall_back(self, states: list[EngineState], reason: str, why: str, request_id: str,
                   exc: BaseException | None = None) -> int:  # fmt: skip
        """Count a router failure and pick with ``least_loaded`` instead; the first failure of each reason is
        logged with its traceback, later ones in one line (a broken router fails every request)."""
        count = self.num_router_fallbacks[reason] = self.num_router_fallbacks.get(reason, 0) + 1
        logger.error("%s failed for request %s (%s); routing it with least_loaded (fallback %d)", self.router_label,
                     request_id, why, count, exc_info=exc if count == 1 else None)  # fmt: skip
        return least_loaded(states)

    def _prefix_hashes(self, request: EngineCoreRequest) -> Sequence[bytes]:
        """The prompt's block hashes as the engines' prefix caches compute them (all engines serve the same
        model, so the first one's block size and salt stand for all)."""
        ready = next((client.ready for client in self.clients if client.ready is not None), None)
        if ready is None:
            return ()
        salt = lora_cache_salt(request.lora_request, request.cache_salt)  # as the engine salts an adapter's
        return block_hashes(request.prompt_token_ids, ready.block_size, ready.hash_salt, salt)


class DisaggregatedGroup(EngineGroup):
    """A prefill engine (client 0) and a decode engine (client 1) serving as one.

    Each request goes to the prefill engine first, as a one-token request whose finished blocks the prefill
    engine's ``zmq-push`` tier ships to the decode engine; then the request itself goes to the decode engine
    (``kv_transfer_params``: ``do_remote_prefill``), which waits for those blocks, loads them instead of
    computing the prompt, and streams the completion. The request's stream is the decode engine's from the
    start, so an abort or the decode engine's death reaches it at any point. If the prefill engine is down or
    refuses the request, the decode engine computes the prompt itself: slower, same output. No router: the
    two engines play different parts, so there is nothing to choose between.
    """

    def __init__(self, prefill: EngineClient, decode: EngineClient) -> None:
        super().__init__([prefill, decode])
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def is_serving(self) -> bool:
        """Whether the decode engine is up (without the prefill engine, it computes prompts itself)."""
        return not self.clients[1].is_dead

    @property
    def max_num_seqs(self) -> int:
        decode = self.clients[1]
        return decode.ready.max_num_seqs if decode.ready and not decode.is_dead else 0

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
    config: EngineConfig,
    count: int,
    transport: Transport,
    configs: Sequence[EngineConfig] = (),
    socket_dir: str | None = None,
) -> list[EngineClient]:
    """Start ``count`` engine processes on ipc:// addresses in ``socket_dir`` (default: a new temporary
    directory, removed once every engine stopped), engine i with ``configs[i]`` when given, else ``config``;
    returns their (unstarted) clients, which restart them (``server.max_engine_restarts``).

    Each engine runs in a fresh interpreter (``LocalEngineProcess``), so the front end never imports torch and
    never shares state with the engine. Each engine builds its own instance of the transport ``config``
    selects; ``transport`` is this process's instance of it.
    """
    socket_dir = socket_dir or tempfile.mkdtemp(prefix="tokenmill-")
    clients = []
    for index in range(count):
        address = f"ipc://{os.path.join(socket_dir, f'engine-{index}.sock')}"
        engine_config = configs[index] if configs else config
        process = LocalEngineProcess(engine_config.to_dict(), address)
        process.start()
        clients.append(EngineClient(address, transport, index, process, config.server.engine_timeout,
                                    config.server.max_engine_restarts))  # fmt: skip
    return clients
