"""``tokenmill bench engine-kills`` against a real server with a tiny model: each kill fails the streams in
flight, a new engine serves, and nothing is left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from tokenmill_plugins.commands.bench.cli import bench

from tests.factories import save_hf_model

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the default model's vocabulary (the bench's prompts are token ids up to 20,000)."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_hf_model("llama-tiny", directory, vocab_size=49152)
    return directory


def test_two_kills_under_load(tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path) -> None:
    output = tmp_path / "kills.json"
    result = CliRunner().invoke(
        bench,
        [
            "engine-kills", "--kills", "2", "--concurrency", "3", "--input-len", "8", "--output-len", "1000",
            "--server-timeout", "120", "--output-json", str(output),
            "--model", str(tiny_model_dir), "--tokenizer", str(smollm2_gguf), "--served-model-name", "tiny",
            "--num-kv-blocks", "2048", "--device", "cpu",
        ],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    results = json.loads(output.read_text())["results"]
    assert len(results["kills"]) == 2
    for kill in results["kills"]:
        assert kill["streams_failed"] == kill["streams_in_flight"] == 3
        assert kill["fail_s"] < 5 and kill["new_engine"] and kill["old_engine_gone"] and kill["num_engines"] == 1
        assert kill["load_s"] is not None and kill["serve_s"] < kill["load_s"] + 10
    assert results["exit_status"] == 0 and results["processes_left"] == [] and results["port_free"]
    assert results["socket_dirs_left"] == []
    assert results["before"]["listening_ports"] == results["after"]["listening_ports"]
    assert "| 2 | 3/3 |" in result.output
