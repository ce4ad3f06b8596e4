"""Routing policies: which engine replica gets a request. Runs in the front end (no torch)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from tokenmill.hookspecs import Register, hookimpl
from tokenmill.messages import EngineCoreRequest


@dataclass(frozen=True)
class EngineState:
    """What the front end knows of one engine when routing (from its latest heartbeat)."""

    index: int
    is_healthy: bool
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_in_flight: int  # requests this front end sent that have not finished


class RoutingPolicy(ABC):
    """Picks an engine for each request. Built once per front end with no arguments;
    ``select`` is called once per request, in the front end's event loop, and must not block."""

    name: ClassVar[str]

    @abstractmethod
    def select(self, request: EngineCoreRequest, engines: list[EngineState]) -> int:
        """The ``index`` of a healthy engine (the caller guarantees one exists)."""


class RoundRobinPolicy(RoutingPolicy):
    name: ClassVar[str] = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, request: EngineCoreRequest, engines: list[EngineState]) -> int:
        healthy = [engine for engine in engines if engine.is_healthy]
        choice = healthy[self._next % len(healthy)]
        self._next += 1
        return choice.index


@hookimpl
def tokenmill_register_routing_policies(register: Register) -> None:
    register("round-robin", "tokenmill.routing:RoundRobinPolicy")
