"""Benchmarks: ``tokenmill bench serve`` (any OpenAI-compatible server), ``bench latency``
and ``bench throughput`` (the offline engine), and the comparison suite ``bench decode``,
``sweep``, ``prefix`` and ``prefill`` (a tokenmill server against transformers on the same model).

The serve benchmark needs only the HTTP client; importing this package never imports torch.
"""

from __future__ import annotations

from tokenmill_plugins.commands.bench.cli import bench
from tokenmill_plugins.commands.bench.hf_baseline import HFBaselineError, HFModel, run_hf_generate, run_hf_prefill
from tokenmill_plugins.commands.bench.local_server import LocalServer, ServerStartError, start_local_server
from tokenmill_plugins.commands.bench.metrics import (
    RequestRecord,
    ServeSummary,
    Stats,
    format_table,
    percentile,
    summarize_serve,
)
from tokenmill_plugins.commands.bench.offline import LatencySummary, ThroughputSummary, run_latency, run_throughput
from tokenmill_plugins.commands.bench.roofline import Roofline, count_parameters, decode_roofline, kv_bytes_read
from tokenmill_plugins.commands.bench.suite import (
    SuiteOptions,
    format_comparison,
    run_decode,
    run_prefill,
    run_prefix,
    run_sweep,
)
from tokenmill_plugins.commands.bench.workload import (
    arrival_times,
    random_texts,
    random_token_ids,
    sample_lengths,
    shared_prefix_prompts,
)

__all__ = [
    "HFBaselineError",
    "HFModel",
    "LatencySummary",
    "LocalServer",
    "RequestRecord",
    "Roofline",
    "ServeSummary",
    "ServerStartError",
    "Stats",
    "SuiteOptions",
    "ThroughputSummary",
    "arrival_times",
    "bench",
    "count_parameters",
    "decode_roofline",
    "format_comparison",
    "format_table",
    "kv_bytes_read",
    "percentile",
    "random_texts",
    "random_token_ids",
    "run_decode",
    "run_hf_generate",
    "run_hf_prefill",
    "run_latency",
    "run_prefill",
    "run_prefix",
    "run_sweep",
    "run_throughput",
    "sample_lengths",
    "shared_prefix_prompts",
    "start_local_server",
    "summarize_serve",
]
