"""The comparison suite end to end: real ``tokenmill serve`` subprocesses and real transformers on a tiny
random model, at tiny lengths. Figures are timing-dependent, so the tests check counts and arithmetic."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from tokenmill_plugins.commands.bench.cli import bench
from tokenmill_plugins.commands.bench.local_server import ServerStartError, start_local_server
from tokenmill_plugins.commands.bench.roofline import kv_bytes_read, weight_bytes_per_step
from tokenmill_plugins.commands.bench.suite import format_comparison
from tokenmill_plugins.commands.bench.workload import shared_prefix_prompts

from tests.factories import save_hf_model
from tokenmill.config import load_config
from tokenmill.models.architecture import ArchitectureConfig


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ArchitectureConfig]:
    """A tiny random Llama with the default model's vocabulary size, so its tokenizer fits."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    model = save_hf_model("llama-tiny", directory, vocab_size=49152)
    return directory, ArchitectureConfig.from_hf_config(model.config.to_dict())


@pytest.fixture
def engine_flags(tiny_model: tuple[Path, ArchitectureConfig], smollm2_gguf: Path) -> list[str]:
    # One thread for the server and for transformers: two busy threads on a shared 2-core machine crawl.
    return [
        *("--model", str(tiny_model[0]), "--tokenizer", str(smollm2_gguf), "--device", "cpu"),
        *("--num-threads", "1", "--num-kv-blocks", "512", "--no-progress"),
    ]


def _bench(tmp_path: Path, *args: str) -> tuple[str, dict[str, Any]]:
    path = tmp_path / "report.json"
    result = CliRunner().invoke(bench, [*args, "--output-json", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout, json.loads(path.read_text())


def _ratio_line(table: str, label: str) -> str:
    (line,) = [line for line in table.splitlines() if line.startswith(label)]
    return line.removeprefix(label).strip()


def test_decode_measures_both_and_prints_their_ratio(
    engine_flags: list[str], tiny_model: tuple[Path, ArchitectureConfig], tmp_path: Path
) -> None:
    table, report = _bench(
        tmp_path, "decode", *engine_flags,
        *("--input-len", "24", "--output-len", "6", "--num-requests", "3", "--peak-bandwidth-gbs", "10"),
    )  # fmt: skip
    results = report["results"]
    tm, hf, speedup = results["tokenmill"], results["transformers"], results["speedup"]
    assert (tm["num_completed"], tm["num_failed"]) == (3, 0)
    assert (tm["total_input_tokens"], tm["total_output_tokens"]) == (3 * 24, 3 * 6)
    assert (hf["batch_size"], hf["num_input_tokens"], hf["generated_tokens_per_row"], hf["num_output_tokens"]) == (
        1, 24, 6, 6,
    )  # fmt: skip
    # Speedups: throughput tokenmill / transformers, latency transformers / tokenmill.
    assert speedup["output_throughput"] == pytest.approx(tm["output_throughput"] / hf["output_throughput"])
    assert speedup["ttft_p50"] == pytest.approx(hf["ttft_ms"] / tm["ttft_ms"]["p50"])
    assert speedup["itl_p50"] == pytest.approx(hf["itl_ms"] / tm["itl_ms"]["p50"])
    assert _ratio_line(table, "vs transformers: output tok/s") == f"{speedup['output_throughput']:.2f}x"
    # The roofline at the ITL p50: float32 weights and the KV of 24 + 6 // 2 tokens.
    arch = tiny_model[1]
    roofline = results["roofline"]
    assert roofline["weight_bytes"] == weight_bytes_per_step(arch, 4)
    assert roofline["kv_bytes"] == kv_bytes_read(arch, [27], dtype_bytes=4)
    assert roofline["step_time_s"] == pytest.approx(tm["itl_ms"]["p50"] / 1000)
    assert roofline["fraction"] == pytest.approx(roofline["achieved_gbs"] / 10)
    assert "Fraction of roofline" in table
    # What ran: the server got the flags, transformers the same dtype and thread count.
    parameters = report["parameters"]
    assert (parameters["device"], parameters["num_threads"], parameters["hf_dtype"]) == ("cpu", 1, "float32")
    assert parameters["config"]["cache"]["num_kv_blocks"] == 512

    # Without the baseline the same table says so instead of printing a ratio.
    report["results"] = {**results, "transformers": None, "speedup": dict.fromkeys(speedup)}
    assert _ratio_line(format_comparison(report), "vs transformers: output tok/s") == "not measured"


def test_sweep_reports_each_levels_roofline(
    engine_flags: list[str], tiny_model: tuple[Path, ArchitectureConfig], tmp_path: Path
) -> None:
    """With --peak-bandwidth-gbs, a level of c streams counts the weights once and c streams' KV at their mean
    length, at that level's ITL p50."""
    table, report = _bench(
        tmp_path, "sweep", *engine_flags, "--concurrency", "1,2", "--input-len", "8", "--output-len", "4",
        "--num-requests", "2", "--no-hf-baseline", "--peak-bandwidth-gbs", "10",
    )  # fmt: skip
    arch = tiny_model[1]
    for level in report["results"]["levels"]:
        roofline, concurrency = level["roofline"], level["concurrency"]
        assert roofline["weight_bytes"] == weight_bytes_per_step(arch, 4)
        assert roofline["kv_bytes"] == kv_bytes_read(arch, [8 + 4 // 2] * concurrency, dtype_bytes=4)
        assert roofline["step_time_s"] == pytest.approx(level["tokenmill"]["itl_ms"]["p50"] / 1000)
        assert roofline["fraction"] == pytest.approx(roofline["achieved_gbs"] / 10)
    assert report["parameters"]["peak_bandwidth_gbs"] == 10
    (header,) = [line for line in table.splitlines() if line.split()[:2] == ["conc", "reqs"]]
    assert header.split()[-1] == "roof"


def test_prefix_caching_on_and_off(engine_flags: list[str], tmp_path: Path) -> None:
    table, report = _bench(
        tmp_path, "prefix", *engine_flags,
        *("--prefix-len", "64", "--question-len", "4", "8", "--output-len", "3", "--num-requests", "4"),
    )  # fmt: skip
    results = report["results"]
    _, *prompts = shared_prefix_prompts(5, 64, (4, 8), seed=0)  # the first one is the warm-up
    input_tokens = sum(len(p) for p in prompts)
    for run in ("cached", "uncached"):
        assert (results[run]["num_completed"], results[run]["num_failed"]) == (4, 0)
        assert (results[run]["total_input_tokens"], results[run]["total_output_tokens"]) == (input_tokens, 4 * 3)
    # With caching, every measured prompt finds the 64-token prefix (4 blocks of 16) the warm-up left.
    assert results["cached"]["prefix_cache_hits"] == 4 * 64
    assert results["cached"]["prefix_cache_queries"] == input_tokens
    assert results["uncached"]["prefix_cache_hits"] == results["uncached"]["prefix_cache_queries"] == 0
    cached, uncached = results["cached"]["ttft_ms"]["p50"], results["uncached"]["ttft_ms"]["p50"]
    assert results["ttft_p50_cached_over_uncached"] == pytest.approx(cached / uncached)
    hf = results["transformers"]
    assert hf["input_len"] == len(prompts[0])
    assert results["speedup"]["cached_ttft_p50"] == pytest.approx(hf["prefill_s"] * 1000 / cached)
    assert results["speedup"]["uncached_ttft_p50"] == pytest.approx(hf["prefill_s"] * 1000 / uncached)
    assert f"{results['ttft_p50_cached_over_uncached']:.2f}x" in table
    (hits_row,) = [line for line in table.splitlines() if line.startswith("Prefix-cache hit tokens")]
    assert hits_row.split()[-2:] == ["256", "0"]


def test_a_server_that_dies_is_a_one_line_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(overrides={"model": {"model": str(tmp_path / "missing")}, "device": {"device": "cpu"}})
    with caplog.at_level(logging.ERROR), pytest.raises(ServerStartError) as error:
        start_local_server(config, tmp_path, timeout_s=120)
    message = str(error.value)
    assert "\n" not in message and "exited with status 1 before it was healthy" in message
    # The cause (the server's own one-line error, or the engine's traceback), never just that the engine exited.
    assert ("ModelNotFoundError: model" in message or "Error: model '" in message) and "missing" in message
    assert "last lines of the tokenmill serve log" in caplog.text


def test_missing_model_or_transformers_fails_before_any_server_starts(
    engine_flags: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    result = CliRunner().invoke(bench, ["prefill", "--model", str(tmp_path / "missing")])
    assert result.exit_code == 1 and result.output.count("\n") == 1 and "not found" in result.output
    monkeypatch.setitem(sys.modules, "transformers", None)
    result = CliRunner().invoke(bench, ["sweep", *engine_flags, "--concurrency", "1,2"])
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert "pip install transformers" in result.output and "--no-hf-baseline" in result.output


def test_a_sweep_warms_up_with_as_many_requests_at_once_as_its_largest_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, Triton compiles kernels for each new batch shape on first use; a single warm-up request left
    that to the first level's measured requests (an H100's first sweep: TTFT p95 715 ms at c=64, 259-278 after)."""
    import contextlib

    from tokenmill_plugins.commands.bench import suite

    loads: list[dict[str, Any]] = []

    def run_load(server: object, options: suite.SuiteOptions, **kwargs: Any) -> dict[str, Any]:
        loads.append(kwargs)
        return {"num_completed": kwargs["num_requests"], "errors": {}, "output_throughput": 1.0}

    monkeypatch.setattr(suite, "_server", lambda options, config: contextlib.nullcontext(object()))
    monkeypatch.setattr(suite, "_run_load", run_load)
    monkeypatch.setattr(suite, "_check_inputs", lambda options: None)
    options = suite.SuiteOptions(load_config(overrides={"device": {"device": "cpu"}}), hf_baseline=False)
    suite.run_sweep(options, concurrency=(1, 8, 3), input_len=16, output_len=32)
    warm_up, *measured = loads
    assert warm_up["num_requests"] == warm_up["concurrency"] == 8
    assert warm_up["output_len"] < 32 and warm_up["seed"] != options.seed
    assert [load["concurrency"] for load in measured] == [1, 8, 3]
