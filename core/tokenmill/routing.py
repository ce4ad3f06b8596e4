"""The router interface: which engine replica serves a request. Runs in the front end (no torch).

The front end keeps, per engine, the latest stats the engine sent with its
outputs and heartbeats, at least once per step it runs (running and waiting
requests, outstanding tokens, KV cache usage and free blocks, and a summary of
its prefix cache: ``tokenmill.prefix_summary``) plus the requests it has in
flight there, and asks the router once per request. A router that sets
``needs_prefix_hashes`` also gets the chained hashes of the prompt's full KV
blocks, computed with the engines' block size and hash salt and the request's
``cache_salt`` exactly as the engines' prefix caches compute them
(``tokenmill.kv_cache.block_hash``), and each ``EngineState`` says how many of
the prompt's leading tokens that engine holds (``num_cached_prefix_tokens``), so
it can send a request where its prefix is cached. With LoRA, each
``EngineState`` also names the adapters the engine holds (``lora_adapters``:
those its running and waiting requests name, and those of this front end's
requests in flight there) and says how many it runs at once (``max_loras``).

A router that raises, or returns something that is not a healthy engine's
index, does not fail the request: the front end routes that request with
``least_loaded`` and counts it (``tokenmill:router_fallbacks_total``).
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
    """What the front end knows of one engine when routing (from its latest stats message).

    The load fields add the front end's estimate for requests it sent since that message (the engine has
    not counted them yet), so a burst of requests routed between two messages spreads as it should.
    """

    index: int
    is_healthy: bool
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests, 0..1
    num_in_flight: int  # requests this front end sent that have not finished
    #: Tokens of work queued there: prompt tokens not computed yet plus tokens still to generate
    #: (``max_tokens``), over its requests (the engine's count, plus the estimate for requests since).
    num_outstanding_tokens: int = 0
    #: KV headroom: tokens of KV cache an allocation can take (free and unused cached blocks), less the
    #: estimate for requests sent since the engine's count.
    num_free_kv_tokens: int = 0
    #: Leading tokens of this request's prompt whose KV blocks the engine's prefix cache holds (or that were
    #: routed there lately); 0 unless the router ``needs_prefix_hashes``.
    num_cached_prefix_tokens: int = 0
    #: LoRA adapters (``lora_name``) the engine holds for requests: those of its running and waiting requests
    #: (its stats' ``running_lora_adapters`` and ``waiting_lora_adapters``) plus those of the requests this front
    #: end has in flight there (from when it sends them until they end, whatever the stats say meanwhile), so a
    #: burst of requests for an adapter follows the first one before the engine reports it. Each takes one of
    #: its ``max_loras`` slots while its requests run; an adapter whose requests all ended is not listed. Empty
    #: without LoRA.
    lora_adapters: frozenset[str] = frozenset()
    #: Adapters the engine runs at once (``lora.max_loras``, its slots); 0 without LoRA or before its first stats.
    max_loras: int = 0


class Router(ABC):
    """Picks an engine for each request.

    Built once per front end with no arguments (plus ``options=`` when its plugin declares options).
    ``select`` is called once per request, in the front end's event loop, and must not block. If it
    raises or returns an index that is not a healthy engine, that request goes to the engine
    ``least_loaded`` picks instead, the fallback is logged and counted
    (``tokenmill:router_fallbacks_total{router, reason}``), and the server keeps serving.
    ``tokenmill.testing.check_router`` checks the contract.
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


def least_loaded(engines: Sequence[EngineState]) -> int:
    """The index of the healthy engine with the fewest outstanding tokens (ties: fewest requests in flight,
    then lowest index). The ``least_loaded`` router, and what the front end falls back to when a router
    fails. The caller guarantees a healthy engine."""
    best = min(
        (engine for engine in engines if engine.is_healthy),
        key=lambda engine: (engine.num_outstanding_tokens, engine.num_in_flight, engine.index),
    )
    return best.index


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
    register("round_robin", "tokenmill.routing:RoundRobinRouter")  # vLLM's and SGLang's spelling
