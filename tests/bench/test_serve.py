"""``bench serve`` end to end against a fake OpenAI-compatible streaming server."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from tokenmill_plugins.commands.bench.cli import bench
from tokenmill_plugins.commands.bench.serve import BenchmarkError, ServeOptions, run_serve
from tokenmill_plugins.commands.bench.workload import MAX_TOKEN_ID, MIN_TOKEN_ID, arrival_times, sample_lengths

from tests.bench.fake_server import CHUNK_DELAY, FIRST_CHUNK_DELAY, MODEL, TOKENS_PER_CHUNK, FakeServerState, serve_fake


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FakeServerState]]:
    state = FakeServerState()
    with serve_fake(state) as url:
        yield url, state


@pytest.fixture
def fake(server: tuple[str, FakeServerState]) -> tuple[str, FakeServerState]:
    server[1].reset()
    return server


def _serve(tmp_path: Path, *args: str) -> tuple[str, dict[str, Any]]:
    path = tmp_path / "report.json"
    result = CliRunner().invoke(bench, ["serve", *args, "--output-json", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout, json.loads(path.read_text())


def test_counts_tokens_latencies_and_json(fake: tuple[str, FakeServerState], tmp_path: Path) -> None:
    url, state = fake
    table, report = _serve(
        tmp_path,
        *("--url", url, "--concurrency", "4", "--num-requests", "20"),
        *("--input-len", "16", "--output-len", "8", "--api-key", "sk-secret"),
    )
    results = report["results"]
    # Requests 4, 9, 14, 19 get a 500; 6 and 13 break mid-stream: none of it stops the run.
    assert (results["num_completed"], results["num_failed"]) == (14, 6)
    assert results["errors"] == {"HTTP 500: injected failure": 4, "error in stream: engine died": 2}
    assert (results["total_input_tokens"], results["total_output_tokens"]) == (14 * 16, 14 * 8)
    assert results["output_throughput"] == pytest.approx(14 * 8 / results["duration_s"])
    assert results["request_throughput"] == pytest.approx(14 / results["duration_s"])
    # The server's sleeps bound the figures from below; a generous margin above for slow machines.
    ttft, itl, e2e = results["ttft_ms"], results["itl_ms"], results["e2e_ms"]
    assert 1000 * FIRST_CHUNK_DELAY <= ttft["p50"] < 1000 * FIRST_CHUNK_DELAY + 150
    per_token_ms = 1000 * CHUNK_DELAY / TOKENS_PER_CHUNK  # 2 tokens a chunk: each chunk's gap is halved
    assert 0.9 * per_token_ms <= itl["p50"] < 1.6 * per_token_ms
    assert ttft["p50"] <= ttft["p95"] <= ttft["p99"]
    min_e2e_ms = 1000 * (FIRST_CHUNK_DELAY + (8 // TOKENS_PER_CHUNK - 1) * CHUNK_DELAY)
    assert min_e2e_ms <= e2e["p50"] < min_e2e_ms + 300
    # What was sent: token-id prompts of exactly the input length, the discovered model, the benchmark knobs.
    assert len(state.bodies) == 20
    for body in state.bodies:
        assert body["model"] == MODEL
        assert len(body["prompt"]) == 16 and all(MIN_TOKEN_ID <= t < MAX_TOKEN_ID for t in body["prompt"])
        assert body["max_tokens"] == 8 and body["ignore_eos"] is True and body["temperature"] == 0
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert all(h["authorization"] == "Bearer sk-secret" for h in state.headers)
    # The report: parameters, provenance, per-request rows; never the key.
    assert report["parameters"]["concurrency"] == 4 and report["parameters"]["model"] == MODEL
    assert report["parameters"]["request_rate"] == "inf"
    assert report["tokenmill_version"] and report["date"]
    assert len(report["requests"]) == 20 and sum(r["success"] for r in report["requests"]) == 14
    assert "sk-secret" not in json.dumps(report)
    assert "Successful requests" in table and "TTFT (ms)" in table and "injected failure" in table


def test_poisson_rate_and_mixed_lengths(fake: tuple[str, FakeServerState], tmp_path: Path) -> None:
    url, state = fake
    state.reset(inject_failures=False)
    _, report = _serve(
        tmp_path,
        *("--url", url, "--model", "named", "--concurrency", "12", "--num-requests", "12"),
        *("--input-len", "32", "--output-len", "6", "--mixed", "--seed", "5", "--request-rate", "10", "--no-progress"),
    )
    input_lens = sample_lengths(12, 32, seed=5, mixed=True, stream=0)
    output_lens = sample_lengths(12, 6, seed=5, mixed=True, stream=1)
    assert len(set(input_lens)) > 1
    assert sorted(len(b["prompt"]) for b in state.bodies) == sorted(input_lens)
    assert sorted(b["max_tokens"] for b in state.bodies) == sorted(output_lens)
    assert {b["model"] for b in state.bodies} == {"named"}
    results = report["results"]
    assert results["num_completed"] == 12
    assert results["total_output_tokens"] == sum(output_lens)
    assert results["total_input_tokens"] == sum(input_lens)
    # Requests arrive on the seeded Poisson schedule, not all at once.
    span = arrival_times(12, 10.0, seed=5)[-1]
    assert span > 0.5  # this seed's schedule: long enough to tell from all-at-once
    assert state.arrivals[-1] - state.arrivals[0] == pytest.approx(span, abs=0.1)
    assert results["duration_s"] >= span


def test_chat_endpoint_reads_delta_content(fake: tuple[str, FakeServerState], tmp_path: Path) -> None:
    url, state = fake
    state.reset(inject_failures=False)
    _, report = _serve(
        tmp_path, "--url", url + "/v1/", "--endpoint", "chat", "--num-requests", "3", "--output-len", "4"
    )
    assert report["results"]["num_completed"] == 3
    assert report["results"]["total_output_tokens"] == 12
    assert all(len(b["messages"][0]["content"].split()) == 256 for b in state.bodies)
    assert report["results"]["total_input_tokens"] == 3 * 256  # the server's usage count


def test_unreachable_server_fails_every_request_but_finishes(tmp_path: Path) -> None:
    _, report = _serve(tmp_path, "--url", "http://127.0.0.1:9", "--model", "m", "--num-requests", "3")
    assert (report["results"]["num_completed"], report["results"]["num_failed"]) == (0, 3)
    assert list(report["results"]["errors"]) == ["ConnectError: All connection attempts failed"]


def test_no_model_and_no_server_is_a_one_line_error() -> None:
    result = CliRunner().invoke(bench, ["serve", "--url", "http://127.0.0.1:9", "--num-requests", "1"])
    assert result.exit_code == 1
    assert "Traceback" not in result.output and result.output.count("\n") == 1
    assert "/v1/models" in result.output and "--model" in result.output


def test_serve_benchmark_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from tokenmill_plugins.commands.bench.cli import bench\n"
        "from tokenmill_plugins.commands.bench.serve import ServeOptions, run_serve\n"
        "run_serve(ServeOptions(url='http://127.0.0.1:9', model='m', num_requests=1, input_len=4, output_len=2,"
        " show_progress=False))\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_explicit_prompts_are_sent_as_given_and_kept_out_of_the_report(fake: tuple[str, FakeServerState]) -> None:
    url, state = fake
    state.reset(inject_failures=False)
    prompts = [[1000 + i] * (3 + i) for i in range(4)]
    options = ServeOptions(url=url, num_requests=4, input_len=5, output_len=2, prompts=prompts, show_progress=False)
    report = run_serve(options)
    assert sorted(body["prompt"] for body in state.bodies) == prompts
    assert report["results"]["total_input_tokens"] == sum(len(p) for p in prompts)
    assert "prompts" not in report["parameters"]
    with pytest.raises(BenchmarkError, match="prompts=3 is invalid: must be one per request"):
        ServeOptions(url=url, num_requests=4, input_len=5, output_len=2, prompts=prompts[:3])
    with pytest.raises(BenchmarkError, match="endpoint='chat'"):
        ServeOptions(url=url, num_requests=4, input_len=5, output_len=2, prompts=prompts, endpoint="chat")


def test_token_id_prompts_stay_below_a_known_vocabulary() -> None:
    """``bench isa`` runs models of any vocabulary: its random prompts must be ids the model has."""
    from tokenmill_plugins.commands.bench.serve import ServeOptions, make_requests
    from tokenmill_plugins.commands.bench.workload import MAX_TOKEN_ID

    options = ServeOptions(url="http://127.0.0.1:1", num_requests=8, input_len=64, output_len=4, vocab_size=512)
    small = [token for request in make_requests(options) for token in request.payload["prompt"]]
    assert max(small) < 512
    unbounded = make_requests(ServeOptions(url="http://127.0.0.1:1", num_requests=8, input_len=64, output_len=4))
    assert 512 <= max(token for request in unbounded for token in request.payload["prompt"]) < MAX_TOKEN_ID
