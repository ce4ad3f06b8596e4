"""Engine replicas as Ray actors: ``tokenmill serve --backend ray --data-parallel-size N``.

The front end joins a Ray cluster (``server.ray_address``, else ``RAY_ADDRESS``,
else a cluster of its own on this host, stopped with the server), reserves one
bundle per replica in a placement group (``ray_num_cpus_per_replica``,
``ray_num_gpus_per_replica``, laid out by ``ray_placement_strategy``) and starts
an ``EngineActor`` in each bundle. An actor runs a real engine
(``run_engine_process``) on a thread of its own, bound to ZeroMQ ``tcp://`` at
a free port on its node's address, and tells the front end where: from then on
the front end talks to it exactly as to any engine (``EngineClient``). Each
time it starts an engine the actor makes a fresh CURVE key pair and lets in
only the front end's public key (the front end's own certificate,
``transport.curve_secret_key_file``, or a key pair it makes at start-up): every
connection is authenticated and encrypted, and no secret key crosses Ray.

Ray restarts an actor whose process dies (``max_restarts=-1``). Meanwhile the
engine client has seen the actor's ``serve`` call fail: it failed the requests
that were on it with 503, the router skips it, and once Ray has it back the
client asks it for its (new) address and keys, starts its engine and
reconnects; ``server.max_engine_restarts`` bounds the failed attempts in a row,
as for local engines. The other replicas serve throughout.

Only ``RayEngineBackend.connect`` (``tokenmill_plugins.ray_backend.backend``)
imports this module, when ``server.backend = 'ray'``: Ray is an optional extra
(``pip install tokenmill[ray]``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import os
import socket
import threading
import time
from typing import Any

import msgspec
import ray
import zmq
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tokenmill import envs
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.engine_client import EngineClient, EngineDeadError
from tokenmill.engine_process import run_engine_process
from tokenmill.transport.base import Transport, TransportSecurity
from tokenmill.transport.security import frontend_security

logger = logging.getLogger(__name__)

#: Actors are named ``tokenmill-engine-<index>``, in the front end's own (anonymous) Ray namespace.
ACTOR_NAME_PREFIX = "tokenmill-engine-"
_PLACEMENT_LOG_INTERVAL_S = 10.0
_LEFTOVER_ENGINE_STOP_S = 30.0
_CONNECT_CHECK_TIMEOUT_S = 5.0
_UNAVAILABLE_RETRY_S = 0.2
# Replicas pass Ray only small objects (addresses, keys): a local cluster's object store need not take Ray's
# default of 30% of memory (in /dev/shm, which containers keep small).
_LOCAL_OBJECT_STORE_BYTES = 128 * 2**20


class ReplicaInfo(msgspec.Struct, frozen=True):
    """What an actor reports about the engine it is about to start (and, from ``info``, the one it runs)."""

    address: str  # tcp://node-ip:port
    public_key: bytes | None  # the engine's CURVE public key; None without keys
    pid: int
    node_id: str
    node_ip: str


@ray.remote(concurrency_groups={"control": 1})  # type: ignore[call-overload]
class EngineActor:
    """One engine replica, in a Ray worker process. ``serve`` runs the engine on the actor's default thread
    until ``stop``; ``prepare``, ``info`` and ``stop`` run on a ``control`` thread, so they answer while the
    engine runs. Ray runs ``__init__`` again in a fresh process when it restarts the actor; the front end
    then calls ``prepare`` and ``serve`` again."""

    def __init__(self, config_data: dict[str, Any], frontend_public_key: bytes | None, max_message_size: int):
        self._config_data = config_data
        self._frontend_public_key = frontend_public_key
        self._max_message_size = max_message_size
        self._prepared: dict[str, TransportSecurity] = {}  # address -> the keys its engine will serve with
        self._stop = threading.Event()
        self._idle = threading.Event()  # no engine runs in this process
        self._idle.set()
        self._info: ReplicaInfo | None = None

    @ray.method(concurrency_group="control")
    def prepare(self) -> ReplicaInfo:
        """Pick the address (a free port on this node) and the key pair of the next engine; an engine still
        running here, which the front end lost track of, is stopped first."""
        if not self._idle.is_set():
            self._stop.set()
            self._idle.wait(_LEFTOVER_ENGINE_STOP_S)
        node_ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in node_ip else socket.AF_INET) as sock:
            sock.bind((node_ip, 0))
            port = sock.getsockname()[1]
        host = f"[{node_ip}]" if ":" in node_ip else node_ip
        address = f"tcp://{host}:{port}"
        public_key: bytes | None = None
        security = TransportSecurity(max_message_size=self._max_message_size)
        if self._frontend_public_key is not None:
            public_key, secret_key = zmq.curve_keypair()
            allowed = frozenset({self._frontend_public_key})
            security = TransportSecurity(public_key, secret_key, allowed, None, self._max_message_size)
        self._prepared = {address: security}
        node_id = ray.get_runtime_context().get_node_id()
        self._info = ReplicaInfo(address, public_key, os.getpid(), node_id, node_ip)
        return self._info

    def serve(self, address: str) -> None:
        """Load the model and serve ``address`` (from ``prepare``) until ``stop``; raises what the engine raised."""
        security = self._prepared.pop(address)
        self._stop.clear()
        self._idle.clear()
        try:
            run_engine_process(self._config_data, address, stop=self._stop, security=security)
        finally:
            self._idle.set()

    @ray.method(concurrency_group="control")
    def info(self) -> ReplicaInfo | None:
        """Where this replica's engine serves, its pid and node (None before the first ``prepare``)."""
        return self._info

    @ray.method(concurrency_group="control")
    def stop(self) -> None:
        """Ask the engine to stop after its current step (it flushes its KV tiers); ``serve`` then returns."""
        self._stop.set()


class RayEngineReplica:
    """The front end's handle on one ``EngineActor``: the ``EngineProcess`` its ``EngineClient`` supervises.

    Called from the front end's event loop; Ray calls are submitted without waiting, and their results awaited.

    :param security: the front end's keys (its public key is the one the engine lets in), or None for none.
    """

    def __init__(self, name: str, options: dict[str, Any], args: tuple[Any, ...],
                 security: TransportSecurity | None) -> None:  # fmt: skip
        self.name = name
        self._options = options
        self._args = args
        self._security = security
        self._actor = self._create()
        self._serving: concurrent.futures.Future[None] | None = None  # the actor's current serve call
        #: What the actor reported for its current engine.
        self.info: ReplicaInfo | None = None

    def _is_placed(self) -> bool:
        strategy = self._options.get("scheduling_strategy")
        return strategy is None or bool(strategy.placement_group.wait(timeout_seconds=0))

    def _create(self) -> Any:
        return EngineActor.options(name=self.name, **self._options).remote(*self._args)  # type: ignore[attr-defined]

    @property
    def pid(self) -> int | None:
        return self.info.pid if self.info is not None else None

    def is_alive(self) -> bool:
        return self._serving is not None and not self._serving.done()

    @property
    def exit_reason(self) -> str:
        serving = self._serving
        if serving is None or not serving.done():
            return "was stopped"
        exc = serving.exception()
        if exc is None:
            return "stopped serving"
        if isinstance(exc, ray.exceptions.RayTaskError):  # the engine raised
            return f"failed in Ray actor {self.name}: {_first_line(exc.cause)}"
        return f"(Ray actor {self.name}) died ({type(exc).__name__}: {_first_line(exc)[:120]})"

    async def locate(self, timeout: float) -> tuple[str, TransportSecurity | None]:
        """Wait for the actor (Ray may still be placing or restarting it), have it pick an address and keys,
        start its engine there; returns them. A Ray actor that is gone for good is replaced by a new one."""
        deadline = time.monotonic() + timeout
        is_replaced = False
        while True:
            try:
                reference = self._actor.prepare.remote()
                info = await asyncio.wait_for(asyncio.wrap_future(reference.future()), deadline - time.monotonic())
                break
            except TimeoutError:
                raise EngineDeadError(
                    f"Ray actor {self.name} did not start within {timeout:.0f} s (placed: "
                    f"{self._is_placed()}; free in the cluster: {ray.available_resources()})"
                ) from None
            except ray.exceptions.ActorUnavailableError as exc:  # restarting while the call was on its way: again
                if time.monotonic() >= deadline:
                    raise EngineDeadError(f"Ray actor {self.name} stayed unavailable: {_first_line(exc)}") from None
                await asyncio.sleep(_UNAVAILABLE_RETRY_S)
            except ray.exceptions.ActorDiedError as exc:
                if is_replaced:
                    raise EngineDeadError(f"Ray actor {self.name} died while starting: {_first_line(exc)}") from None
                logger.warning("Ray actor %s is gone for good (%s); starting a new one", self.name, _first_line(exc))
                self._actor = self._create()
                is_replaced = True
            except ray.exceptions.RayError as exc:
                raise EngineDeadError(f"Ray actor {self.name} did not answer: {_first_line(exc)}") from None
        self.info = info
        self._serving = self._actor.serve.remote(info.address).future()
        logger.info("engine replica %s: pid %d on node %s (%s), serving %s", self.name, info.pid,
                    info.node_id[:12], info.node_ip, info.address)  # fmt: skip
        if self._security is None or info.public_key is None:
            return info.address, None
        return info.address, dataclasses.replace(self._security, engine_public_key=info.public_key)

    async def restart(self) -> None:
        # Ray restarts an actor whose process died by itself; ``locate`` waits for it and starts its engine.
        self._serving = None

    def kill(self) -> None:
        """Kill the actor's process now (a hung engine); Ray starts it again."""
        if self.is_alive():
            ray.kill(self._actor, no_restart=False)

    async def stop(self, timeout: float) -> None:
        """Ask the engine to stop, wait up to ``timeout`` s, then kill the actor for good."""
        serving = self._serving
        if serving is not None and not serving.done():
            self._actor.stop.remote()
            await asyncio.wait({asyncio.wrap_future(serving)}, timeout=timeout)
        ray.kill(self._actor, no_restart=True)


def _check_reachable(address: str) -> None:
    """Fail in seconds, with one line, where ``ray.init`` would retry an address nobody answers at for minutes."""
    if address.startswith("ray://"):
        raise ConfigError(
            f"server.ray_address {address!r}: Ray Client addresses are not supported; run the front end on a node "
            "of the cluster and give its GCS address (HOST:6379)"
        )
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():  # 'auto', 'local': Ray resolves those itself
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_CHECK_TIMEOUT_S).close()
    except OSError as exc:
        raise ConfigError(
            f"server.ray_address: no Ray cluster answers at {address!r} ({exc}); start one there with "
            "`ray start --head`, or fix the address"
        ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


class RayCluster:
    """The front end's part in a Ray cluster: its connection and its replicas' placement group.

    ``connect`` blocks (starting a local cluster takes seconds); call it before installing signal handlers, as
    ``ray.init`` installs its own SIGTERM handler.
    """

    def __init__(self, config: EngineConfig, is_local: bool) -> None:
        self.config = config
        self.is_local = is_local
        self.placement_group: PlacementGroup | None = None
        self._placing: asyncio.Task[None] | None = None

    @classmethod
    def connect(cls, config: EngineConfig) -> RayCluster:
        server = config.server
        address = server.ray_address or envs.RAY_ADDRESS.get()
        if address:
            _check_reachable(address)
            logger.info("joining the Ray cluster at %s", address)
            try:
                ray.init(address=address, log_to_driver=True)
            except ConnectionError as exc:
                raise ConfigError(f"server.ray_address: cannot join the Ray cluster at {address!r}: {exc}") from None
            return cls(config, is_local=False)
        num_cpus = max(os.cpu_count() or 1, math.ceil(server.data_parallel_size * server.ray_num_cpus_per_replica))
        logger.info("starting a Ray cluster on this host (%d CPUs)", num_cpus)
        ray.init(address="local", num_cpus=num_cpus, object_store_memory=_LOCAL_OBJECT_STORE_BYTES,
                 include_dashboard=False, log_to_driver=True)  # fmt: skip
        return cls(config, is_local=True)

    def num_gpus_per_replica(self) -> float:
        server = self.config.server
        if server.ray_num_gpus_per_replica is not None:
            return server.ray_num_gpus_per_replica
        device = self.config.device.device
        has_gpus = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        return float(self.config.parallel.tensor_parallel_size) if has_gpus else 0.0

    def start_engines(self, transport: Transport) -> list[EngineClient]:
        """Ask for the replicas' bundles and one actor in each; returns their (unstarted) engine clients, whose
        ``start`` waits for Ray to place them. Until the bundles are placed, what the cluster has free is logged
        every 10 s."""
        config, server = self.config, self.config.server
        count = server.data_parallel_size
        bundle = {"CPU": server.ray_num_cpus_per_replica}
        num_gpus = self.num_gpus_per_replica()
        if num_gpus:
            bundle["GPU"] = num_gpus
        group = placement_group([bundle] * count, strategy=server.ray_placement_strategy, name="tokenmill-engines")
        self.placement_group = group
        self._placing = asyncio.create_task(self._log_until_placed(group, bundle, count))
        security = self._frontend_security(transport)
        frontend_key = security.public_key if security is not None else None
        args = (config.to_dict(), frontend_key, config.transport.max_message_bytes)
        clients = []
        for index in range(count):
            options = {
                "num_cpus": bundle["CPU"], "num_gpus": num_gpus, "max_restarts": -1, "max_task_retries": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
            }  # fmt: skip
            replica = RayEngineReplica(f"{ACTOR_NAME_PREFIX}{index}", options, args, security)
            clients.append(EngineClient(replica.name, transport, index, replica, server.engine_timeout,
                                        server.max_engine_restarts, security))  # fmt: skip
        return clients

    async def _log_until_placed(self, group: PlacementGroup, bundle: dict[str, float], count: int) -> None:
        ready = asyncio.wrap_future(group.ready().future())
        try:
            while not (await asyncio.wait({ready}, timeout=_PLACEMENT_LOG_INTERVAL_S))[0]:
                logger.warning(
                    "waiting for the Ray cluster to place %d replica(s) of %s each (%s); free now: %s; lower "
                    "data_parallel_size or ray_num_cpus_per_replica, or add nodes", count, bundle,
                    self.config.server.ray_placement_strategy, ray.available_resources(),
                )  # fmt: skip
        finally:
            ready.cancel()  # stopped while waiting: the group's removal must not log an unretrieved error

    def _frontend_security(self, transport: Transport) -> TransportSecurity | None:
        """The front end's keys: its certificate when configured, else a key pair made now."""
        if not transport.supports_security:
            return None
        transport_config = self.config.transport
        if transport_config.curve_secret_key_file is not None:
            return frontend_security(transport_config)
        public_key, secret_key = zmq.curve_keypair()
        return TransportSecurity(public_key, secret_key, max_message_size=transport_config.max_message_bytes)

    def close(self) -> None:
        """Leave the cluster, stopping it when this server started it. Ray removes the replicas' placement
        group when its job (this front end) ends; the engine clients stopped their actors before."""
        if self._placing is not None:
            self._placing.cancel()
        ray.shutdown()
