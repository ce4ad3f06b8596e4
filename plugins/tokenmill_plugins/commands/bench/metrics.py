"""Benchmark figures: percentile statistics, per-request records, and the report
(a JSON-ready dict, also rendered as a table).

Times are measured in seconds and reported in milliseconds (per-token figures)
or seconds (durations), as each key's suffix says.
"""

from __future__ import annotations

import json
import logging
import math
import platform
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

import tokenmill

logger = logging.getLogger(__name__)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between ranks
    (numpy's default), so p50 of an even count is the mean of the middle two."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile must be in [0, 100], got {q}")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass(frozen=True)
class Stats:
    """Mean and percentiles of one figure over requests, tokens or iterations."""

    mean: float
    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float], scale: float = 1.0) -> Stats | None:
        """Stats of ``values`` times ``scale`` (1000 turns seconds into ms); None when empty."""
        if not values:
            return None
        scaled = [v * scale for v in values]
        return cls(float(np.mean(scaled)), percentile(scaled, 50), percentile(scaled, 95), percentile(scaled, 99))


@dataclass
class RequestRecord:
    """What one benchmark request did. Times are in seconds from when it was sent."""

    num_prompt_tokens: int  # as sent; replaced by the server's usage count when it gives one
    max_tokens: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # to the first chunk with content
    latency: float = 0.0  # to the end of the response (E2E)
    itls: list[float] = field(default_factory=list)  # one entry per token after the first chunk's
    num_output_tokens: int = 0


def inter_token_latencies(
    chunk_times: Sequence[float], num_tokens: int, chunk_num_tokens: Sequence[int] | None = None
) -> list[float]:
    """Per-token gaps from the arrival times of a stream's content chunks.

    A chunk that carries k tokens splits the gap before it into k equal parts.
    ``chunk_num_tokens`` gives each chunk's count when the server reported it;
    otherwise the ``num_tokens`` tokens are assumed spread evenly over the chunks
    (the remainder on the first ones), which is exact for servers that send a
    fixed number of tokens per chunk. With fewer tokens than chunks each chunk
    counts as one token. The first chunk's tokens have no gap before them (that is TTFT).
    """
    num_chunks = len(chunk_times)
    if num_chunks < 2:
        return []
    if chunk_num_tokens is not None:
        assert len(chunk_num_tokens) == num_chunks
        counts = list(chunk_num_tokens)
    elif num_tokens >= num_chunks:
        base, extra = divmod(num_tokens, num_chunks)
        counts = [base + (i < extra) for i in range(num_chunks)]
    else:
        counts = [1] * num_chunks
    itls: list[float] = []
    previous = chunk_times[0]
    for time, count in zip(chunk_times[1:], counts[1:], strict=True):
        if count <= 0:
            continue  # an empty delta: its gap belongs to the next chunk with tokens
        itls += [(time - previous) / count] * count
        previous = time
    return itls


@dataclass(frozen=True)
class ServeSummary:
    num_completed: int
    num_failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # input + output tokens per second
    ttft_ms: Stats | None
    itl_ms: Stats | None
    e2e_ms: Stats | None
    errors: dict[str, int]  # error text -> how many requests failed with it


def summarize_serve(records: Sequence[RequestRecord], duration: float) -> ServeSummary:
    """Totals, throughputs and latency statistics over the successful requests."""
    done = [r for r in records if r.success]
    input_tokens = sum(r.num_prompt_tokens for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    per_s = 1.0 / duration if duration > 0 else math.nan
    return ServeSummary(
        num_completed=len(done),
        num_failed=len(records) - len(done),
        duration_s=duration,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) * per_s,
        output_throughput=output_tokens * per_s,
        total_token_throughput=(input_tokens + output_tokens) * per_s,
        ttft_ms=Stats.of([r.ttft for r in done], 1000),
        itl_ms=Stats.of([itl for r in done for itl in r.itls], 1000),
        e2e_ms=Stats.of([r.latency for r in done], 1000),
        errors=dict(Counter(r.error for r in records if not r.success).most_common()),
    )


def build_report(benchmark: str, parameters: dict[str, Any], results: Any) -> dict[str, Any]:
    """The report: which benchmark, when, on what, with which parameters, and its results
    (a dataclass or dict whose ``Stats`` values become ``{mean, p50, p95, p99}``)."""
    return {
        "benchmark": benchmark,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "tokenmill_version": tokenmill.__version__,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "parameters": parameters,
        "results": asdict(results) if not isinstance(results, dict) else results,
    }


def write_json(report: dict[str, Any], path: Path) -> None:
    # allow_nan=False: a NaN would make the file invalid JSON for strict readers.
    path.write_text(json.dumps(_finite(report), indent=2, allow_nan=False) + "\n")
    logger.info("wrote %s", path)


def _finite(value: Any) -> Any:
    """NaN and infinity as strings ("nan", "inf"), which JSON has no numbers for."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


_LABELS = {
    "num_completed": "Successful requests",
    "num_failed": "Failed requests",
    "duration_s": "Duration (s)",
    "total_input_tokens": "Total input tokens",
    "total_output_tokens": "Total output tokens",
    "request_throughput": "Request throughput (req/s)",
    "output_throughput": "Output token throughput (tok/s)",
    "total_token_throughput": "Total token throughput (tok/s)",
    "ttft_ms": "TTFT (ms)",
    "itl_ms": "ITL (ms)",
    "e2e_ms": "E2E latency (ms)",
    "latency_s": "Iteration latency (s)",
    "num_iters": "Timed iterations",
}


def format_header(report: dict[str, Any]) -> list[str]:
    """The first lines of a report's table: its name, version and date, its scalar parameters, a rule.
    Used by ``format_table`` and by the comparison suite's tables."""
    lines = [
        f" {report['benchmark']} benchmark ".center(TABLE_WIDTH, "="),
        row(f"tokenmill {report['tokenmill_version']}", report["date"]),
    ]
    lines += [row(name, value) for name, value in report["parameters"].items() if not isinstance(value, dict | list)]
    return [*lines, "-" * TABLE_WIDTH]


def format_table(report: dict[str, Any]) -> str:
    """The report as aligned text: parameters, scalar results, then one row per statistic."""
    rule = "-" * TABLE_WIDTH
    lines = format_header(report)
    results = report["results"]
    # A statistic is a {mean, p50, p95, p99} dict, or None when nothing was measured.
    stats = [
        name
        for name, value in results.items()
        if value is None or (isinstance(value, dict) and set(value) == set(_STAT_KEYS))
    ]
    lines += [
        row(_LABELS.get(name, name), value)
        for name, value in results.items()
        if name not in stats and not isinstance(value, dict | list)
    ]
    if stats:
        lines += [rule, f"{'':<24}" + "".join(f"{key:>10}" for key in _STAT_KEYS)]
        for name in stats:
            stat = results[name]
            cells = [f"{format_value(stat[key]):>10}" for key in _STAT_KEYS] if stat else [f"{'n/a':>10}"]
            lines.append(f"{_LABELS.get(name, name):<24}" + "".join(cells))
    errors = results.get("errors") or {}
    if errors:
        lines += [rule, "Errors:", *(f"{count:>6} x {text}" for text, count in errors.items())]
    lines.append("=" * TABLE_WIDTH)
    return "\n".join(lines)


#: Characters per line of every benchmark table.
TABLE_WIDTH = 64
_STAT_KEYS = ("mean", "p50", "p95", "p99")


def row(label: str, value: Any) -> str:
    return f"{label:<40}{format_value(value):>24}"


def format_value(value: Any) -> str:
    """A table cell: floats with 2 decimals (3 below 10), None as "-", anything else as ``str``."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.2f}" if abs(value) >= 10 else f"{value:.3f}"  # small values keep 3 decimals
    return "-" if value is None else str(value)
