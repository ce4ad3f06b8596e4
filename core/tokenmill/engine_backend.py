"""The engine backend interface: where a server's engine replicas run (slot ``engine_backend``).

``server.backend`` (``--backend``) picks it. The default, ``'local'``, is the
core's own path and no plugin: engine processes on this host
(``tokenmill.engine_launcher``), or the engines ``server.engines`` names, or a
disaggregated prefill/decode pair. Any other name is an engine backend a plugin
registers (``tokenmill_register_engine_backends``; the first-party plugin
``ray_backend`` registers ``ray``: replicas as Ray actors). A backend places
``server.data_parallel_size`` replicas of the engine somewhere else and hands
the front end one ``EngineClient`` per replica; from then on the front end
treats them as it treats its local engines: the clients supervise them through
each replica's ``EngineProcess`` (locate, restart, kill, stop), and the router
(``server.router``) picks among them.

Runs in the API front end only, which imports no torch: keep a backend's module free of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.engine_client import EngineClient
    from tokenmill.transport.base import Transport


class EngineBackend(ABC):
    """Starts a server's engine replicas somewhere other than this host's processes.

    Built once per server, in the front end (``tokenmill serve``'s process), from the resolved config:
    ``cls(config)``, plus ``options=`` when its plugin declares options. The constructor only keeps what it
    needs (it may read settings of its own from ``config.server``) and must not block. The front end then
    calls ``connect``, ``start_engines`` and, on the way out, ``close``, each once, from its event loop's
    thread; no method is called per request.
    """

    def connect(self) -> None:
        """Reach whatever will run the replicas (join a cluster, start one). Default: nothing to do.

        Called once by the front end, before it installs its signal handlers and before any engine starts
        (a library such as Ray installs a SIGTERM handler of its own there). May block: nothing is served
        yet. A wrong setting or a missing dependency raises ``tokenmill.config.ConfigError`` with one line
        saying what to change.
        """

    @abstractmethod
    def start_engines(self, transport: Transport) -> list[EngineClient]:
        """Ask for ``server.data_parallel_size`` replicas; returns their engine clients, unstarted.

        Called once by the front end, after ``connect``, on its event loop (it may create tasks there); must
        not block: placing and loading the replicas happens in each client's ``start``, which the front end
        awaits and a signal can interrupt. Client ``i`` has index ``i`` and an ``EngineProcess`` (its
        ``process``) that finds, restarts, kills and stops replica ``i``; the clients connect over
        ``transport``, the one the front end built from ``transport.backend``.
        """

    def close(self) -> None:
        """Release what ``connect`` took (leave or stop the cluster). Default: nothing to do.

        Called once by the front end when ``connect`` returned, on its way out, after every engine client was
        closed (the replicas stopped), also when starting failed or a signal came first. May block briefly.
        """
