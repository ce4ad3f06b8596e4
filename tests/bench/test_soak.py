"""``tokenmill bench soak``: its workload, its report's arithmetic, its chart, and a short soak of a real server."""

from __future__ import annotations

import csv
import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from tokenmill_plugins.commands.bench.cli import bench
from tokenmill_plugins.commands.bench.process_rss import process_role
from tokenmill_plugins.commands.bench.soak import (
    Sample,
    SoakError,
    SoakOptions,
    SoakWorkload,
    _rss_table,
    parse_metrics,
)
from tokenmill_plugins.commands.bench.svg_chart import Panel, line_chart_svg, nice_ticks

from tests.factories import save_hf_model
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest


def _options(tmp_path: Path, **overrides: object) -> SoakOptions:
    return SoakOptions(base_url="http://127.0.0.1:1", output_dir=tmp_path, **overrides)  # type: ignore[arg-type]


def test_workload_is_seeded_mixed_and_valid(tmp_path: Path) -> None:
    options = _options(tmp_path, input_len=(8, 64), output_len=(4, 32), abort_fraction=0.1, seed=3)
    workload = SoakWorkload(options)
    requests = [workload.request(i) for i in range(800)]
    assert [r.payload for r in requests[:50]] == [SoakWorkload(options).request(i).payload for i in range(50)]
    assert requests[0].payload != SoakWorkload(_options(tmp_path, seed=4)).request(0).payload
    shares = {tag: sum(tag in r.shape() for r in requests) / len(requests)
              for tag in ("chat", "stream", "n>1", "stop", "logprobs", "planned-abort")}  # fmt: skip
    expected = {"chat": 0.5, "stream": 0.5, "n>1": 0.25, "stop": 0.3, "logprobs": 0.3, "planned-abort": 0.1}
    assert shares == pytest.approx(expected, abs=0.06)
    for request in requests:
        body = {"model": "m", **request.payload}
        parsed = msgspec.convert(body, ChatCompletionRequest if request.endpoint == "chat" else CompletionRequest)
        assert 4 <= (parsed.max_tokens or 0) <= 32
        if request.endpoint == "completions" and isinstance(parsed.prompt, list):
            assert 8 <= len(parsed.prompt) <= 64 + 256  # (plus a shared document, sometimes)
        if request.n > 1:
            assert request.payload["temperature"] > 0  # n identical greedy choices would test little
        assert request.is_abort == (request.abort_after_chunks is not None or request.abort_at is not None)
        if request.abort_after_chunks is not None:
            assert request.stream and 0 <= request.abort_after_chunks <= request.payload["max_tokens"]
    assert not any(r.is_abort for r in map(SoakWorkload(_options(tmp_path, abort_fraction=0)).request, range(200)))
    assert all(r.is_abort for r in map(SoakWorkload(_options(tmp_path, abort_fraction=1)).request, range(200)))


@pytest.mark.parametrize(
    "overrides",
    [{"warmup_s": 10.0, "duration_s": 10.0}, {"concurrency": 0}, {"input_len": (9, 8)}, {"abort_fraction": 1.5}],
)
def test_options_say_what_is_wrong(tmp_path: Path, overrides: dict[str, object]) -> None:
    with pytest.raises(SoakError, match=next(iter(overrides)).removesuffix("_s")):
        _options(tmp_path, **overrides)


def _sample(t: float, phase: str, kv_touched_mib: float = 0.0, **rss_mib: float) -> Sample:
    rss = {key: int(value * 2**20) for key, value in rss_mib.items()}
    return Sample(t, phase, rss, kv_cache_usage=0.0, kv_cache_touched_bytes=kv_touched_mib * 2**20, num_running=0,
                  num_waiting=0, requests_sent=0, errors=0)  # fmt: skip


def test_rss_growth_is_from_the_warmup_end_to_the_last_sample_under_load() -> None:
    samples = [
        _sample(0, "warmup", frontend=80, engine=500),
        _sample(5, "warmup", frontend=90, engine=900),  # the warm-up's own growth does not count
        _sample(10, "load", frontend=100, engine=1000),
        _sample(15, "load", frontend=101, engine=1200, child=30),  # a helper that came later
        _sample(20, "load", frontend=102, engine=1030),
        _sample(25, "drain", frontend=102, engine=1050),
        _sample(30, "idle", frontend=102, engine=1040),
    ]
    rows = {row["process"]: row for row in _rss_table(samples, max_growth_pct=5.0)}
    assert rows["engine"] == {
        "process": "engine", "warmup_end_mib": 1000.0, "end_mib": 1030.0, "idle_mib": 1040.0, "peak_mib": 1200.0,
        "kv_touched_growth_mib": 0.0, "growth_pct": 3.0, "growth_ok": True,
    }  # fmt: skip
    assert rows["frontend"]["growth_pct"] == 2.0
    assert rows["child"]["growth_pct"] is None and rows["child"]["growth_ok"] is None
    assert rows["total"]["warmup_end_mib"] == 1100.0 and rows["total"]["growth_pct"] == pytest.approx(2.91, abs=0.01)
    assert _rss_table(samples[:2], max_growth_pct=5.0) == []  # no sample under load: nothing to say


def test_rss_growth_is_net_of_the_kv_caches_first_touches() -> None:
    """A CPU engine's cache pages become resident as blocks are first used: that growth is the cache, not a leak,
    and is split between the engine processes; anything beyond it still fails the check."""
    samples = [
        _sample(10, "load", kv_touched_mib=100, frontend=100, **{"engine-1": 1000, "engine-2": 1000}),
        _sample(20, "load", kv_touched_mib=300, frontend=100, **{"engine-1": 1100, "engine-2": 1180}),
    ]
    rows = {row["process"]: row for row in _rss_table(samples, max_growth_pct=5.0)}
    assert rows["engine-1"]["kv_touched_growth_mib"] == 100.0 and rows["engine-1"]["growth_pct"] == 0.0
    assert rows["engine-2"]["growth_pct"] == 8.0 and rows["engine-2"]["growth_ok"] is False
    assert rows["frontend"]["kv_touched_growth_mib"] == 0.0
    assert rows["total"]["kv_touched_growth_mib"] == 200.0 and rows["total"]["growth_pct"] == pytest.approx(3.81, 0.01)


def test_metrics_are_summed_over_engines() -> None:
    text = (
        "# TYPE tokenmill:kv_cache_usage_perc gauge\n"
        'tokenmill:kv_cache_usage_perc{model_name="m",engine="0"} 0.25\n'
        'tokenmill:kv_cache_usage_perc{model_name="m",engine="1"} 0.5\n'
    )
    assert parse_metrics(text) == {"tokenmill:kv_cache_usage_perc": 0.75}
    assert parse_metrics("other 1\n") == {"other": 1.0}


def test_process_roles() -> None:
    spawn = ["python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=7)"]
    assert process_role(spawn, is_root=False) == "engine"
    assert process_role(["python3", "-c", "from multiprocessing.resource_tracker import main"], is_root=False) == (
        "resource-tracker"
    )
    assert process_role(["/venv/bin/python3", "-m", "tokenmill.cli", "serve"], is_root=True) == "frontend"
    assert process_role(["/usr/bin/ninja"], is_root=False) == "ninja"


def test_chart_is_svg_with_round_ticks() -> None:
    assert nice_ticks(0, 97) == [0, 20, 40, 60, 80, 100]
    assert nice_ticks(2150, 3210) == [2000, 2500, 3000, 3500]
    assert nice_ticks(5, 5) == [5, 6, 7, 8, 9, 10]
    panel = Panel("RSS", "MiB", {"engine <1>": [(0, 10.0), (5, 12.0)], "empty": []})
    svg = line_chart_svg([panel, Panel("KV", "%", y_min=0)], x_label="s", markers=[(2, "warm-up end")], title="t")
    root = ElementTree.fromstring(svg)
    assert root.tag.endswith("svg")
    assert svg.count("<polyline") == 1 and "engine &lt;1&gt;" in svg and "warm-up end" in svg


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the default model's vocabulary, so the default model's tokenizer fits and the
    soak's token-id prompts (ids up to 20,000) are in range."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_hf_model("llama-tiny", directory, vocab_size=49152)
    return directory


@pytest.mark.multiproc
def test_soak_of_a_real_server(tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path) -> None:
    output = tmp_path / "soak"
    result = CliRunner().invoke(
        bench,
        [
            "soak", "--duration", "8s", "--warmup", "3s", "--sample-interval", "1s", "--concurrency", "8",
            "--input-len", "4", "48", "--output-len", "4", "32", "--abort-fraction", "0.3",
            "--max-rss-growth", "1000", "--output-dir", str(output), "--no-progress",
            "--model", str(tiny_model_dir), "--tokenizer", str(smollm2_gguf), "--served-model-name", "tiny",
            "--num-kv-blocks", "1024", "--device", "cpu",
        ],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((output / "report.json").read_text())
    results = report["results"]
    assert report["benchmark"] == "soak" and report["parameters"]["model"] == "tiny"
    assert results["errors"] == 0, (results["errors_by_kind"], results["error_examples"])
    assert results["requests"] >= 20 and results["completed"] > 0 and results["aborted"] > 0
    assert results["requests"] == (results["completed"] + results["aborted"] + results["rejected_429"])
    assert results["idle_at_end"] and results["kv_cache_usage_at_end"] == 0
    assert results["checks"] == {"no_errors": True, "kv_idle_at_end": True, "rss_growth_under_max": True}
    roles = {row["process"].rsplit("-", 1)[0] for row in results["rss"]}
    assert {"frontend", "engine", "total"} <= roles
    assert all(row["warmup_end_mib"] > 0 and row["growth_pct"] is not None for row in results["rss"])
    with (output / "samples.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [rows[0]["phase"], rows[-1]["phase"]] == ["warmup", "idle"] and any(r["phase"] == "load" for r in rows)
    assert float(rows[-1]["kv_cache_usage"]) == 0 and float(rows[-1]["rss_mib_total"]) > 0
    assert len(report["samples"]) == len(rows)
    ElementTree.fromstring((output / "rss.svg").read_text())
    assert list(output.glob("server-*.log")), "the server's log goes beside the report"
    assert "checks: no_errors ok, kv_idle_at_end ok, rss_growth_under_max ok" in result.output
