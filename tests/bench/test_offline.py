"""``bench latency`` and ``bench throughput`` on the default model, with tiny sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from tokenmill_plugins.commands.bench.cli import bench

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ("--device", "cpu", "--kv-cache-memory", "256MiB")


def _bench(tmp_path: Path, model: Path, *args: str) -> tuple[str, dict[str, Any]]:
    path = tmp_path / "report.json"
    result = CliRunner().invoke(
        bench, [*args, "--model", str(model), *ENGINE_FLAGS, "--output-json", str(path)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return result.stdout, json.loads(path.read_text())


def test_latency(tmp_path: Path, smollm2_gguf: Path) -> None:
    table, report = _bench(
        tmp_path,
        smollm2_gguf,
        *("latency", "--input-len", "16", "--output-len", "8", "--batch-size", "2", "--num-iters", "3"),
    )
    results, parameters = report["results"], report["parameters"]
    assert report["benchmark"] == "latency" and results["num_iters"] == 3
    latency = results["latency_s"]
    assert 0 < latency["p50"] <= latency["p99"] < 60
    assert results["output_throughput"] == pytest.approx(2 * 8 / latency["mean"])
    assert results["total_token_throughput"] == pytest.approx(2 * (16 + 8) / latency["mean"])
    assert parameters["batch_size"] == 2 and parameters["config"]["device"]["device"] == "cpu"
    assert parameters["config"]["cache"]["kv_cache_memory"] == "256MiB"
    assert "Iteration latency (s)" in table


def test_throughput(tmp_path: Path, smollm2_gguf: Path) -> None:
    table, report = _bench(
        tmp_path, smollm2_gguf, "throughput", "--num-prompts", "4", "--input-len", "16", "--output-len", "8"
    )
    results = report["results"]
    assert report["benchmark"] == "throughput"
    # min_tokens = max_tokens: every request generates exactly its output length.
    assert (results["num_completed"], results["total_input_tokens"], results["total_output_tokens"]) == (4, 64, 32)
    assert results["duration_s"] > 0
    assert results["output_throughput"] == pytest.approx(32 / results["duration_s"])
    assert results["request_throughput"] == pytest.approx(4 / results["duration_s"])
    assert "Output token throughput (tok/s)" in table


def test_throughput_reports_the_kv_cache_a_budget_buys(tmp_path: Path, smollm2_gguf: Path) -> None:
    """At the same --kv-cache-memory, fp8 and int8 caches hold 128/68 of float16's tokens (head_dim 64: one byte
    per value plus a float32 scale per row, against two bytes per value)."""
    layouts = {}
    for dtype in ("float16", "fp8", "int8"):
        _, report = _bench(
            tmp_path, smollm2_gguf, "throughput", "--kv-cache-dtype", dtype,
            *("--num-prompts", "2", "--input-len", "8", "--output-len", "2"),
        )  # fmt: skip
        layouts[dtype] = report["parameters"]["kv_cache"]
    assert layouts["fp8"]["dtype"] == "float8_e4m3fn" and layouts["int8"]["dtype"] == "int8"
    assert layouts["float16"]["bytes_per_token"] == 30 * 2 * 3 * 64 * 2  # layers, K/V, kv heads, head_dim, bytes
    for dtype in ("fp8", "int8"):
        assert layouts[dtype]["bytes_per_token"] == 30 * 2 * 3 * 68
        assert layouts[dtype]["num_tokens"] / layouts["float16"]["num_tokens"] == pytest.approx(128 / 68, rel=0.01)
        assert layouts[dtype]["num_bytes"] <= 256 * 2**20
