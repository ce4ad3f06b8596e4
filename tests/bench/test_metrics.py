"""Percentiles, statistics, per-token gaps, the serve summary and the report's table and JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from tokenmill_plugins.commands.bench.metrics import (
    RequestRecord,
    Stats,
    build_report,
    format_table,
    inter_token_latencies,
    percentile,
    summarize_serve,
    write_json,
)


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 10.0
    assert percentile(values, 50) == 5.5
    assert percentile(values, 95) == pytest.approx(9.55)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([7.0], 99) == 7.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_stats_scale_seconds_to_ms() -> None:
    stats = Stats.of([0.001, 0.002, 0.003, 0.004], scale=1000)
    assert stats is not None
    assert stats.mean == pytest.approx(2.5)
    assert stats.p50 == pytest.approx(2.5)
    assert stats.p95 == pytest.approx(3.85)
    assert stats.p99 == pytest.approx(3.97)
    assert Stats.of([]) is None


def test_itl_one_token_per_chunk_is_the_gaps() -> None:
    assert inter_token_latencies([0.1, 0.3, 0.6], num_tokens=3) == pytest.approx([0.2, 0.3])


def test_itl_divides_a_gap_over_the_tokens_of_its_chunk() -> None:
    # 8 tokens in 4 chunks: 2 per chunk, so each 0.04 s gap is two 0.02 s tokens.
    itls = inter_token_latencies([0.05, 0.09, 0.13, 0.17], num_tokens=8)
    assert itls == pytest.approx([0.02] * 6)
    # Reported per-chunk counts win over the even split; an empty chunk passes its gap on.
    itls = inter_token_latencies([0.0, 0.1, 0.2, 0.4], num_tokens=6, chunk_num_tokens=[1, 1, 0, 4])
    assert itls == pytest.approx([0.1, 0.075, 0.075, 0.075, 0.075])


def test_itl_edge_cases() -> None:
    assert inter_token_latencies([0.2], num_tokens=5) == []
    assert inter_token_latencies([], num_tokens=0) == []
    # Fewer tokens than chunks (no usage): one token per chunk.
    assert inter_token_latencies([0.0, 0.1, 0.3], num_tokens=1) == pytest.approx([0.1, 0.2])
    # 7 tokens over 3 chunks: 3, 2, 2.
    assert inter_token_latencies([0.0, 0.2, 0.4], num_tokens=7) == pytest.approx([0.1] * 4)


def _record(ttft: float, latency: float, itls: list[float], tokens: int) -> RequestRecord:
    return RequestRecord(10, tokens, True, "", ttft, latency, itls, tokens)


def test_summary_counts_only_successful_requests() -> None:
    records = [
        _record(0.1, 0.5, [0.1, 0.1, 0.2], 4),
        _record(0.3, 0.9, [0.2, 0.2, 0.2], 4),
        RequestRecord(10, 4, error="HTTP 500: boom"),
        RequestRecord(10, 4, error="HTTP 500: boom"),
        RequestRecord(10, 4, error="ReadTimeout"),
    ]
    summary = summarize_serve(records, duration=2.0)
    assert (summary.num_completed, summary.num_failed) == (2, 3)
    assert (summary.total_input_tokens, summary.total_output_tokens) == (20, 8)
    assert summary.request_throughput == pytest.approx(1.0)
    assert summary.output_throughput == pytest.approx(4.0)
    assert summary.total_token_throughput == pytest.approx(14.0)
    assert summary.ttft_ms is not None
    assert (summary.ttft_ms.mean, summary.ttft_ms.p50) == (200.0, 200.0)
    assert (summary.ttft_ms.p95, summary.ttft_ms.p99) == pytest.approx((290.0, 298.0))
    assert summary.itl_ms is not None and summary.itl_ms.mean == pytest.approx(1000 * 1.0 / 6)
    assert summary.itl_ms.p50 == pytest.approx(200.0)
    assert summary.e2e_ms is not None and summary.e2e_ms.p50 == pytest.approx(700.0)
    assert summary.errors == {"HTTP 500: boom": 2, "ReadTimeout": 1}


def test_all_failed_has_no_latency_stats_and_still_renders(tmp_path: Path) -> None:
    summary = summarize_serve([RequestRecord(10, 4, error="ConnectError")], duration=0.5)
    assert summary.num_completed == 0 and summary.ttft_ms is None and summary.output_throughput == 0
    report = build_report("serve", {"request_rate": math.inf}, summary)
    table = format_table(report)
    assert "n/a" in table and "1 x ConnectError" in table
    write_json(report, tmp_path / "r.json")
    loaded = json.loads((tmp_path / "r.json").read_text())
    assert loaded["parameters"]["request_rate"] == "inf"  # JSON has no infinity
    assert loaded["results"]["ttft_ms"] is None


def test_report_has_provenance_and_table_rows() -> None:
    summary = summarize_serve([_record(0.1, 0.5, [0.1], 2)], duration=1.0)
    report = build_report("serve", {"concurrency": 4, "model": "m"}, summary)
    assert report["tokenmill_version"] and report["date"].startswith("20")
    assert report["results"]["ttft_ms"] == {"mean": 100.0, "p50": 100.0, "p95": 100.0, "p99": 100.0}
    lines = format_table(report).splitlines()
    assert any(line.startswith("TTFT (ms)") and line.split()[2:] == ["100.00"] * 4 for line in lines)
    assert any(line.startswith("Successful requests") and line.endswith(" 1") for line in lines)
    assert any(line.startswith("concurrency") and line.endswith(" 4") for line in lines)
