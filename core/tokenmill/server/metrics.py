"""Prometheus metrics of the API server, under vLLM's names (docs/metrics.md).

Every metric is vLLM's ``vllm:<name>`` as ``tokenmill:<name>``, with vLLM's units and labels: ``model_name``
(the served model name) and ``engine`` (the replica index), so a dashboard written for vLLM works once its
prefix is replaced. Latencies are measured in the front end, where a client's experience is: time to first
token, inter-token latency, end-to-end, prefill and decode time per request; queue time comes from the engine
(enqueue to first scheduled step). Engine-wide gauges and counters (running, waiting, KV usage, tokens, prefix
cache, preemptions, speculative decoding, KV tiers, restarts, LoRA adapters) are read from the engines' latest
heartbeats when Prometheus scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "tokenmill:"

#: Reasons a request ends, vLLM's ``finished_reason`` values: ``stop`` and ``length`` finished normally,
#: ``abort`` was cancelled (the client went away) and ``error`` failed (its engine died).
FINISHED_REASONS = ("stop", "length", "abort", "error")

#: ``tokenmill:request_rejected_total`` reasons for errors that carry no code of their own.
_REJECTED_BY_STATUS = {400: "invalid_request", 503: "unavailable"}

_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                          10.0, 20.0, 40.0, 80.0)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
                            640.0, 1280.0, 2560.0)  # fmt: skip

_LABELS = ["model_name", "engine"]

#: Engine counters by ``EngineStatsMessage`` field: (exported name after the prefix, help).
_ENGINE_COUNTERS = {
    "num_prompt_tokens": ("prompt_tokens", "Prompt tokens processed (a request's whole prompt, at its first token)."),
    "num_generation_tokens": ("generation_tokens", "Tokens generated."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    "num_preemptions": ("num_preemptions", "Requests preempted for lack of KV cache blocks."),
    "spec_decode_num_drafts": (
        "spec_decode_num_drafts", "Speculative decoding: requests whose drafts were verified, summed over steps."
    ),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."),
    "spec_decode_num_accepted_tokens": (
        "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."
    ),
}  # fmt: skip


#: KV tier counters by ``KVTierStatsMessage`` field; exported as ``tokenmill:kv_tier_<field>`` by ``tier``.
_KV_TIER_COUNTERS = {
    "hits": "KV tier: blocks fetched.",
    "misses": "KV tier: fetches that found nothing.",
    "bytes_read": "KV tier: bytes fetched.",
    "bytes_written": "KV tier: bytes stored.",
    "rejected": "KV tier: blocks found unusable (corrupt, truncated, foreign) or refused.",
    "errors": "KV tier: I/O failures (the blocks were recomputed instead).",
    "loads": "KV tier: prefixes loaded instead of recomputed, by the deepest tier each read from.",
    "load_seconds": "KV tier: seconds those loads took, from the start of their reads to the device (divide by "
    "loads for the mean load latency).",
}


class _EngineCollector(Collector):
    """Engine state at scrape time, one sample per engine replica (label ``engine``)."""

    def __init__(self, group: Any, model_name: str) -> None:
        self.group = group
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        running = GaugeMetricFamily(f"{PREFIX}num_requests_running", "Requests in the engines' running batches.",
                                    labels=_LABELS)  # fmt: skip
        waiting = GaugeMetricFamily(f"{PREFIX}num_requests_waiting", "Requests waiting in the engines.",
                                    labels=_LABELS)  # fmt: skip
        usage = GaugeMetricFamily(
            f"{PREFIX}kv_cache_usage_perc", "KV cache usage: the fraction of blocks held by requests (1 means 100%).",
            labels=_LABELS,
        )  # fmt: skip
        touched = GaugeMetricFamily(
            f"{PREFIX}kv_cache_touched_bytes",
            "KV cache bytes handed out at least once since start: on a CPU, about the cache's share of the engine's "
            "resident memory, which grows with the load the cache has held, up to its size.",
            labels=_LABELS,
        )
        restarts = CounterMetricFamily(f"{PREFIX}engine_restarts", "Times the engine was restarted after it died.",
                                       labels=_LABELS)  # fmt: skip
        counters = {
            key: CounterMetricFamily(f"{PREFIX}{name}", text, labels=_LABELS)
            for key, (name, text) in _ENGINE_COUNTERS.items()
        }
        per_pos = CounterMetricFamily(
            f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by their position among the drafts (0 first).",
            labels=[*_LABELS, "position"],
        )
        tier_counters = {
            key: CounterMetricFamily(f"{PREFIX}kv_tier_{key}", text, labels=[*_LABELS, "tier"])
            for key, text in _KV_TIER_COUNTERS.items()
        }
        dropped = CounterMetricFamily(
            f"{PREFIX}engine_dropped_messages",
            "Messages an engine dropped unread, by reason: malformed (not one of its message types), oversized (over "
            "transport.max_message_size), multipart.", labels=[*_LABELS, "reason"],
        )  # fmt: skip
        refused = CounterMetricFamily(
            f"{PREFIX}engine_refused_connections",
            "Connections an engine refused during the transport's handshake (CURVE: a key not allowed, or no CURVE).",
            labels=_LABELS,
        )
        for client in self.group.clients:
            labels = [self.model_name, str(client.index)]
            restarts.add_metric(labels, getattr(client, "num_restarts", 0))
            stats = client.stats
            if stats is None:
                continue
            for reason, count in stats.num_dropped_messages.items():
                dropped.add_metric([*labels, reason], count)
            refused.add_metric(labels, stats.num_refused_connections)
            for tier in stats.kv_tiers:
                for key, family in tier_counters.items():
                    family.add_metric([*labels, tier.name], getattr(tier, key))
            running.add_metric(labels, stats.num_running)
            waiting.add_metric(labels, stats.num_waiting)
            usage.add_metric(labels, stats.kv_cache_usage)
            touched.add_metric(labels, stats.kv_cache_touched_bytes)
            for key, family in counters.items():
                family.add_metric(labels, getattr(stats, key))
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([*labels, str(position)], count)
        fallbacks = CounterMetricFamily(
            f"{PREFIX}router_fallbacks",
            "Requests the router failed to place (reason error: it raised; invalid_choice: it returned no healthy "
            "engine's index), routed by least_loaded instead.", labels=["model_name", "router", "reason"],
        )  # fmt: skip
        outstanding = GaugeMetricFamily(
            f"{PREFIX}num_outstanding_tokens", "Tokens of work queued in the engine: prompt tokens not computed yet "
            "plus tokens still to generate (max_tokens), over its requests (what least_loaded compares).",
            labels=_LABELS,
        )  # fmt: skip
        cached_blocks = GaugeMetricFamily(
            f"{PREFIX}prefix_cache_summary_blocks", "Blocks the front end knows the engine's prefix cache holds, "
            "from its stats (what prefix_aware matches prompts against).", labels=_LABELS,
        )  # fmt: skip
        lora_info = GaugeMetricFamily(
            f"{PREFIX}lora_requests_info", "LoRA adapters of the running and waiting requests (comma-separated "
            "names), and max_loras; the value is when it was read (Unix time), as vLLM's.",
            labels=[*_LABELS, "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )  # fmt: skip
        for client in self.group.clients:
            labels = [self.model_name, str(client.index)]
            if client.stats is not None:
                outstanding.add_metric(labels, client.stats.num_outstanding_tokens)
                if client.stats.max_loras:
                    lora_info.add_metric(
                        [*labels, str(client.stats.max_loras), ",".join(client.stats.waiting_lora_adapters),
                         ",".join(client.stats.running_lora_adapters)], time.time(),
                    )  # fmt: skip
            summary = getattr(client, "prefix_cache", None)
            if summary is not None:
                cached_blocks.add_metric(labels, len(summary.keys))
        router_name = getattr(self.group, "router_name", "")
        for reason, count in getattr(self.group, "num_router_fallbacks", {}).items():
            fallbacks.add_metric([self.model_name, router_name, reason], count)
        yield from (running, waiting, usage, touched, restarts, *counters.values(), per_pos, *tier_counters.values(),
                    dropped, refused, outstanding, cached_blocks, fallbacks, lora_info)  # fmt: skip


class ServerMetrics:
    """The front end's metrics; ``app.py`` reports each request's milestones (``engine`` is the index of the
    engine serving it) and each error response."""

    def __init__(self, group: Any, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{PREFIX}{name}", text, _LABELS, registry=self.registry, buckets=buckets)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "From request arrival to its first token.", _TOKEN_LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Between consecutive tokens of a completion.", _TOKEN_LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "From request arrival to its last token.", _REQUEST_LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "In the engine, from enqueue to the first scheduled step.",
            _REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "From the first scheduled step to the first token.",
            _REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "From the first token to the last.", _REQUEST_LATENCY_BUCKETS
        )
        self.request_success = Counter(
            f"{PREFIX}request_success", "Requests ended, by finished_reason: stop, length, abort or error.",
            [*_LABELS, "finished_reason"], registry=self.registry,
        )  # fmt: skip
        self.request_rejected = Counter(
            f"{PREFIX}request_rejected", "Requests answered with an error instead of a completion, by reason.",
            ["model_name", "reason"], registry=self.registry,
        )  # fmt: skip
        # Every engine's series exist from the start, at zero (as vLLM's do), so a dashboard sees them at once.
        for client in group.clients:
            engine = str(client.index)
            for family in (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency,
                           self.request_queue_time, self.request_prefill_time, self.request_decode_time):  # fmt: skip
                family.labels(model_name, engine)
            for reason in FINISHED_REASONS:
                self.request_success.labels(model_name, engine, reason)
        self.registry.register(_EngineCollector(group, model_name))
        # Per tenant (never per key): docs/serving.md#tenants.
        tenant_labels = ["model_name", "tenant"]
        self.tenant_requests = Counter(
            f"{PREFIX}tenant_requests", "Generation requests admitted, by tenant.", tenant_labels,
            registry=self.registry,
        )  # fmt: skip
        self.tenant_prompt_tokens = Counter(
            f"{PREFIX}tenant_prompt_tokens", "Prompt tokens sent to the engines, by tenant.", tenant_labels,
            registry=self.registry,
        )  # fmt: skip
        self.tenant_generation_tokens = Counter(
            f"{PREFIX}tenant_generation_tokens", "Tokens generated, by tenant.", tenant_labels, registry=self.registry
        )
        self.tenant_rejected = Counter(
            f"{PREFIX}tenant_rejected", "Requests of a known key answered with an error, by tenant and reason "
            "(requests_per_minute, tokens_per_minute, max_concurrent_requests, or request_rejected's reasons).",
            [*tenant_labels, "reason"], registry=self.registry,
        )  # fmt: skip

        # Per LoRA adapter (docs/lora.md#metrics): requests and tokens of those naming it (or a key's default).
        self.lora_requests, self.lora_prompt_tokens, self.lora_generation_tokens = (
            Counter(f"{PREFIX}lora_{name}", f"{text}, by LoRA adapter.", ["model_name", "lora_name"],
                    registry=self.registry)
            for name, text in (("requests", "Generation requests sent to the engines"),
                               ("prompt_tokens", "Prompt tokens sent to the engines"),
                               ("generation_tokens", "Tokens generated"))
        )  # fmt: skip

    def observe_lora_request(self, lora_name: str, num_prompt_tokens: int) -> None:
        """A request with adapter ``lora_name`` went to an engine with its prompt of ``num_prompt_tokens``."""
        self.lora_requests.labels(self.model_name, lora_name).inc()
        self.lora_prompt_tokens.labels(self.model_name, lora_name).inc(num_prompt_tokens)

    def observe_lora_tokens(self, lora_name: str, num_generation_tokens: int) -> None:
        self.lora_generation_tokens.labels(self.model_name, lora_name).inc(num_generation_tokens)

    def add_tenants(self, tenants: list[str]) -> None:
        """Start every tenant's usage series at zero, so a dashboard sees them at once."""
        for tenant in tenants:
            for family in (self.tenant_requests, self.tenant_prompt_tokens, self.tenant_generation_tokens):
                family.labels(self.model_name, tenant)

    def observe_tenant_request(self, tenant: str) -> None:
        self.tenant_requests.labels(self.model_name, tenant).inc()

    def observe_tenant_tokens(self, tenant: str, num_prompt_tokens: int = 0, num_generation_tokens: int = 0) -> None:
        if num_prompt_tokens:
            self.tenant_prompt_tokens.labels(self.model_name, tenant).inc(num_prompt_tokens)
        if num_generation_tokens:
            self.tenant_generation_tokens.labels(self.model_name, tenant).inc(num_generation_tokens)

    def observe_queue_time(self, engine: int, seconds: float) -> None:
        self.request_queue_time.labels(self.model_name, str(engine)).observe(seconds)

    def observe_token(self, engine: int, now: float, arrival: float, previous: float | None) -> None:
        """A completion's new tokens arrived at ``now``; ``previous`` is when its last ones did (None: first)."""
        if previous is None:
            self.time_to_first_token.labels(self.model_name, str(engine)).observe(now - arrival)
        else:
            self.inter_token_latency.labels(self.model_name, str(engine)).observe(now - previous)

    def observe_finished(self, engine: int, reason: str, arrival: float, queue_time: float,
                         first_token_at: float | None, last_token_at: float | None, now: float) -> None:  # fmt: skip
        """A request finished normally (``reason`` is ``stop`` or ``length``) at ``now``: count it and time its
        phases. Prefill runs from its first scheduled step (arrival plus queue time) to its first token, decode
        from its first token to its last (of any completion, for n > 1)."""
        labels = (self.model_name, str(engine))
        self.request_success.labels(*labels, reason).inc()
        self.e2e_request_latency.labels(*labels).observe(now - arrival)
        if first_token_at is not None and last_token_at is not None:
            self.request_prefill_time.labels(*labels).observe(max(0.0, first_token_at - arrival - queue_time))
            self.request_decode_time.labels(*labels).observe(last_token_at - first_token_at)

    def observe_unfinished(self, engine: int, reason: str) -> None:
        """A request ended without finishing: ``abort`` (cancelled, or its client went away) or ``error`` (its
        engine died); counted, not timed."""
        self.request_success.labels(self.model_name, str(engine), reason).inc()

    def observe_rejected(
        self, status: int, code: str | None, tenant: str | None = None, tenant_reason: str | None = None
    ) -> None:
        """The server answered a request with HTTP ``status`` and error ``code`` (``queue_full``,
        ``invalid_api_key``...); counted by that code, or by the status when the error has none. A request whose
        key is known is also counted for its ``tenant``, by ``tenant_reason`` (the limit it is over) or that."""
        if status == 499:  # the client went away mid-request: nobody gets this answer, and it counts as abort
            return
        reason = code or _REJECTED_BY_STATUS.get(status, f"http_{status}")
        self.request_rejected.labels(self.model_name, reason).inc()
        if tenant is not None:
            self.tenant_rejected.labels(self.model_name, tenant, tenant_reason or reason).inc()
