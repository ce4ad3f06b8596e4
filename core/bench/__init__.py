"""Benchmarks: ``tokenmill bench serve`` (any OpenAI-compatible server), ``bench latency``
and ``bench throughput`` (the offline engine).

The serve benchmark needs only the HTTP client; importing this package never imports torch.
"""

from __future__ import annotations

from tokenmill.bench.cli import bench
from tokenmill.bench.metrics import RequestRecord, ServeSummary, Stats, format_table, percentile, summarize_serve
from tokenmill.bench.offline import LatencySummary, ThroughputSummary, run_latency, run_throughput
from tokenmill.bench.workload import arrival_times, random_texts, random_token_ids, sample_lengths

__all__ = [
    "LatencySummary",
    "RequestRecord",
    "ServeSummary",
    "Stats",
    "ThroughputSummary",
    "arrival_times",
    "bench",
    "format_table",
    "percentile",
    "random_texts",
    "random_token_ids",
    "run_latency",
    "run_throughput",
    "sample_lengths",
    "summarize_serve",
]
