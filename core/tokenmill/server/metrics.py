"""Prometheus metrics of the API server (names documented in docs/metrics.md).

Latencies are measured in the front end, where a client's experience is:
time to first token, inter-token latency and end-to-end latency per request;
queue time comes from the engine (enqueue to first scheduled step). Engine-wide
gauges and counters (running, waiting, KV usage, prefix cache, preemptions, speculative decoding)
are read from the engines' latest heartbeats when Prometheus scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                    10.0, 20.0, 40.0, 80.0)  # fmt: skip


#: Engine counters by ``EngineStatsMessage`` field; exported as ``tokenmill_<field>`` (vLLM's names).
_ENGINE_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens served from the prefix cache.",
    "num_preemptions": "Requests preempted for lack of KV cache blocks.",
    "spec_decode_num_drafts": "Speculative decoding: requests whose drafts were verified, summed over steps.",
    "spec_decode_num_draft_tokens": "Speculative decoding: draft tokens verified.",
    "spec_decode_num_accepted_tokens": "Speculative decoding: draft tokens accepted.",
}


#: KV tier counters by ``KVTierStatsMessage`` field; exported as ``tokenmill_kv_tier_<field>`` by ``tier``.
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

    def __init__(self, group: Any, model: str) -> None:
        self.group = group
        self.model = model

    def collect(self) -> Iterator[Any]:
        running = GaugeMetricFamily("tokenmill_num_requests_running", "Requests running in the engines.",
                                    labels=["model", "engine"])  # fmt: skip
        waiting = GaugeMetricFamily("tokenmill_num_requests_waiting", "Requests waiting in the engines.",
                                    labels=["model", "engine"])  # fmt: skip
        usage = GaugeMetricFamily("tokenmill_kv_cache_usage_ratio", "Fraction of KV cache blocks held by requests.",
                                  labels=["model", "engine"])  # fmt: skip
        counters = {
            key: CounterMetricFamily(f"tokenmill_{key}", text, labels=["model", "engine"])
            for key, text in _ENGINE_COUNTERS.items()
        }
        per_pos = CounterMetricFamily(
            "tokenmill_spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by their position among the drafts (0 first).",
            labels=["model", "engine", "position"],
        )
        tier_counters = {
            key: CounterMetricFamily(f"tokenmill_kv_tier_{key}", text, labels=["model", "engine", "tier"])
            for key, text in _KV_TIER_COUNTERS.items()
        }
        for client in self.group.clients:
            stats = client.stats
            if stats is None:
                continue
            labels = [self.model, str(client.index)]
            for tier in stats.kv_tiers:
                for key, family in tier_counters.items():
                    family.add_metric([*labels, tier.name], getattr(tier, key))
            running.add_metric(labels, stats.num_running)
            waiting.add_metric(labels, stats.num_waiting)
            usage.add_metric(labels, stats.kv_cache_usage)
            for key, family in counters.items():
                family.add_metric(labels, getattr(stats, key))
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([*labels, str(position)], count)
        yield from (running, waiting, usage, *counters.values(), per_pos, *tier_counters.values())


class ServerMetrics:
    def __init__(self, group: Any, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        labels = ["model"]
        self.time_to_first_token = Histogram(
            "tokenmill_time_to_first_token_seconds", "From request arrival to its first token.",
            labels, registry=self.registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            "tokenmill_inter_token_latency_seconds", "Between consecutive tokens of a completion.",
            labels, registry=self.registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.e2e_latency = Histogram(
            "tokenmill_e2e_request_latency_seconds", "From request arrival to its last token.",
            labels, registry=self.registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue_time = Histogram(
            "tokenmill_request_queue_time_seconds", "In the engine, from enqueue to the first scheduled step.",
            labels, registry=self.registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.prompt_tokens = Counter("tokenmill_prompt_tokens", "Prompt tokens of finished requests.",
                                     labels, registry=self.registry)  # fmt: skip
        self.generation_tokens = Counter("tokenmill_generation_tokens", "Generated tokens.",
                                         labels, registry=self.registry)  # fmt: skip
        self.requests_finished = Counter(
            "tokenmill_requests_finished", "Requests finished, by reason (stop, length, aborted, failed).",
            ["model", "reason"], registry=self.registry,
        )  # fmt: skip
        self.registry.register(_EngineCollector(group, model))

    def observe_token(self, now: float, arrival: float, previous: float | None) -> None:
        if previous is None:
            self.time_to_first_token.labels(self.model).observe(now - arrival)
        else:
            self.inter_token_latency.labels(self.model).observe(now - previous)

    def observe_finished(self, reason: str, arrival: float, now: float, prompt_tokens: int, tokens: int) -> None:
        self.requests_finished.labels(self.model, reason).inc()
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.generation_tokens.labels(self.model).inc(tokens)
        if reason in ("stop", "length"):
            self.e2e_latency.labels(self.model).observe(now - arrival)
