"""The load-, cache- and adapter-aware routers. Run in the API front end, which never imports torch: nor does this.

Every router here picks among healthy engines only, from the ``EngineState`` the front end builds per
request (the engines' latest stats plus its estimate for requests sent since), and never blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from tokenmill import EngineCoreRequest, EngineState, Router
from tokenmill.routing import least_loaded
from tokenmill_plugins.routers.options import RoutersOptions

__all__ = ["KVAwareRouter", "LeastLoadedRouter", "LoRAAwareRouter", "PrefixAwareRouter", "is_imbalanced"]


def _healthy(engines: Sequence[EngineState]) -> list[EngineState]:
    return [engine for engine in engines if engine.is_healthy]


def is_imbalanced(engines: Sequence[EngineState], abs_threshold: int, rel_threshold: float) -> bool:
    """Whether the healthy engines' loads (outstanding tokens) are too far apart to follow a cached prefix:
    the gap exceeds ``abs_threshold`` and the ratio ``rel_threshold`` (both, as SGLang's cache-aware router
    decides)."""
    loads = [engine.num_outstanding_tokens for engine in engines if engine.is_healthy]
    most, least = max(loads), min(loads)
    return most - least > abs_threshold and most > least * rel_threshold


class LeastLoadedRouter(Router):
    """Each request to the healthy engine with the fewest outstanding tokens (prompt tokens not computed yet
    plus tokens still to generate); ties go to the fewest requests in flight, then the lowest index."""

    name: ClassVar[str] = "least_loaded"

    def __init__(self, options: RoutersOptions | None = None) -> None:
        pass

    def select(self, request: EngineCoreRequest, engines: list[EngineState], prefix_hashes: Sequence[bytes]) -> int:
        return least_loaded(engines)


class KVAwareRouter(Router):
    """Each request to the healthy engine with the most KV headroom (``num_free_kv_tokens``: free and unused
    cached blocks, less what requests sent since its last stats will take), so long prompts land where they
    fit without preempting; ties go to the least loaded."""

    name: ClassVar[str] = "kv_aware"

    def __init__(self, options: RoutersOptions | None = None) -> None:
        pass

    def select(self, request: EngineCoreRequest, engines: list[EngineState], prefix_hashes: Sequence[bytes]) -> int:
        best = min(
            _healthy(engines),
            key=lambda e: (-e.num_free_kv_tokens, e.num_outstanding_tokens, e.num_in_flight, e.index),
        )
        return best.index


class PrefixAwareRouter(Router):
    """SGLang's cache-aware policy over the engines' reported prefix caches.

    While the engines' loads are balanced, a request goes to the engine holding the longest cached prefix
    of its prompt (``num_cached_prefix_tokens``, which also counts prefixes routed there lately, before the
    engine computed them), provided that covers at least ``cache_threshold`` of the prompt; ties, and
    prompts no engine holds enough of, go to the least loaded engine. When the loads are imbalanced
    (``is_imbalanced`` with ``balance_abs_threshold`` and ``balance_rel_threshold``) every request goes to
    the least loaded engine, so one hot prefix cannot pile all the work onto one engine.
    """

    name: ClassVar[str] = "prefix_aware"
    needs_prefix_hashes: ClassVar[bool] = True

    def __init__(self, options: RoutersOptions | None = None) -> None:
        self.options = options or RoutersOptions()

    def select(self, request: EngineCoreRequest, engines: list[EngineState], prefix_hashes: Sequence[bytes]) -> int:
        options = self.options
        healthy = _healthy(engines)
        if is_imbalanced(healthy, options.balance_abs_threshold, options.balance_rel_threshold):
            return least_loaded(healthy)
        best = max(healthy, key=lambda e: (e.num_cached_prefix_tokens, -e.num_outstanding_tokens, -e.index))
        num_prompt = len(request.prompt_token_ids)
        if best.num_cached_prefix_tokens > 0 and best.num_cached_prefix_tokens >= options.cache_threshold * num_prompt:
            return best.index
        return least_loaded(healthy)


class LoRAAwareRouter(Router):
    """Sends each request naming a LoRA adapter where that adapter already is, so an adapter is read and takes
    a slot on one engine rather than on every one (llm-d's ``lora-affinity-scorer``, as a policy).

    While the engines' loads are balanced (``is_imbalanced`` with ``balance_abs_threshold`` and
    ``balance_rel_threshold``, as ``prefix_aware``), a request naming an adapter goes to the least loaded engine
    holding it (``EngineState.lora_adapters``: its running or waiting requests name it, or this front end's
    requests in flight there do, so a burst follows its first request); if none holds it, to the least loaded
    engine with a free slot (fewer adapters held than its ``max_loras``), where it runs at once instead of
    waiting for another adapter's requests to end; else to the least loaded engine. Requests for the base model,
    and every request while the loads are imbalanced, go to the least loaded engine. Unlike llm-d's scorer, an
    engine where the adapter's requests wait counts as holding it: its weights are read there, or already are.
    """

    name: ClassVar[str] = "lora_aware"

    def __init__(self, options: RoutersOptions | None = None) -> None:
        self.options = options or RoutersOptions()

    def select(self, request: EngineCoreRequest, engines: list[EngineState], prefix_hashes: Sequence[bytes]) -> int:
        options = self.options
        healthy = _healthy(engines)
        lora = request.lora_request
        if lora is None or is_imbalanced(healthy, options.balance_abs_threshold, options.balance_rel_threshold):
            return least_loaded(healthy)
        holding = [engine for engine in healthy if lora.lora_name in engine.lora_adapters]
        with_free_slot = [engine for engine in healthy if len(engine.lora_adapters) < engine.max_loras]
        return least_loaded(holding or with_free_slot or healthy)
