"""The router interface: which engine replica serves a request. Runs in the front end (no torch).

The front end keeps, per engine, the latest stats the engine sent with its
outputs and heartbeats (running and waiting requests, KV cache usage) plus the
requests it has in flight there, and asks the router once per request. A router
that sets ``needs_prefix_hashes`` also gets the chained hashes of the prompt's
full KV blocks, computed with the engines' block size and hash salt and the
request's ``cache_salt`` exactly as the engines' prefix caches compute them
(``tokenmill.kv_cache.block_hash``), so it can send a request where its prefix
is cached.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from tokenmill.hookspecs import Register, hookimpl
from tokenmill.messages import EngineCoreRequest


@dataclass(frozen=True)
class EngineState:
    """What the front end knows of one engine when routing (from its latest stats message)."""

    index: int
    is_healthy: bool
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_in_flight: int  # requests this front end sent that have not finished


class Router(ABC):
    """Picks an engine for each request.

    Built once per front end with no arguments (plus ``options=`` when its plugin declares options).
    ``select`` is called once per request, in the front end's event loop, and must not block. If it
    raises or returns an index that is not a healthy engine, that request fails with an OpenAI-shaped
    error naming the router, and the server keeps serving. ``tokenmill.testing.check_router`` checks
    the contract.
    """

    #: Registered name.
    name: ClassVar[str]
    #: Whether ``select`` reads ``prefix_hashes`` (they cost a hash per prompt block to compute).
    needs_prefix_hashes: ClassVar[bool] = False

    @abstractmethod
    def select(self, request: EngineCoreRequest, engines: list[EngineState], prefix_hashes: Sequence[bytes]) -> int:
        """The ``index`` of a healthy engine (the caller guarantees one exists).

        :param prefix_hashes: hashes of the prompt's full blocks, first block first; empty unless
            ``needs_prefix_hashes``.
        """


class RoundRobinRouter(Router):
    """Each request to the next healthy engine in turn."""

    name: ClassVar[str] = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, request: EngineCoreRequest, engines: list[EngineState], prefix_hashes: Sequence[bytes]) -> int:
        healthy = [engine for engine in engines if engine.is_healthy]
        choice = healthy[self._next % len(healthy)]
        self._next += 1
        return choice.index


@hookimpl
def tokenmill_register_routers(register: Register) -> None:
    register("round-robin", "tokenmill.routing:RoundRobinRouter")
