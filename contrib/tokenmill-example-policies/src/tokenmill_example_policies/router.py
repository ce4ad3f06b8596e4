"""``least-in-flight``: each request to the healthy engine with the fewest requests in flight from here.

Runs in the API front end, which never imports torch: this module must not either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from tokenmill import EngineCoreRequest, EngineState, Router
from tokenmill_example_policies.options import ExamplePoliciesOptions


class LeastInFlightRouter(Router):
    """Picks the healthy engine with the fewest in-flight requests; ties by lowest index (the default) or by
    fewest waiting (``prefer_lowest_index = false``)."""

    name: ClassVar[str] = "least-in-flight"

    def __init__(self, options: ExamplePoliciesOptions | None = None) -> None:
        self.prefer_lowest_index = (options or ExamplePoliciesOptions()).prefer_lowest_index

    def select(self, request: EngineCoreRequest, engines: list[EngineState], prefix_hashes: Sequence[bytes]) -> int:
        healthy = [engine for engine in engines if engine.is_healthy]
        if self.prefer_lowest_index:
            return min(healthy, key=lambda e: (e.num_in_flight, e.index)).index
        return min(healthy, key=lambda e: (e.num_in_flight, e.num_waiting, e.index)).index
