"""Against llm-compressor itself, where it is installed (it pins another transformers than tokenmill's
tests, so CI skips this; ``tests/quantize/make_reference_checkpoints.py`` runs it from its own venv)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("llmcompressor")


def test_same_config_tensors_and_first_layer_codes(tmp_path: Path) -> None:
    import subprocess
    import sys

    from click.testing import CliRunner
    from safetensors import safe_open

    from tests.factories import save_tiny_model
    from tokenmill.cli import main

    model = save_tiny_model(tmp_path / "tiny", "llama-tiny", seed=5, hidden_size=128, intermediate_size=256)
    script = Path(__file__).with_name("make_reference_checkpoints.py")
    args = ["--num-samples", "8", "--seq-len", "64"]
    subprocess.run([sys.executable, str(script), str(model), str(tmp_path / "lc"), *args], check=True)
    result = CliRunner().invoke(
        main, ["quantize", str(model), "--method", "gptq", "--output", str(tmp_path / "tm"), *args]
    )
    assert result.exit_code == 0, result.output
    configs = [json.loads((tmp_path / d / "config.json").read_text())["quantization_config"] for d in ("tm", "lc")]
    assert configs[0] == configs[1]
    with (
        safe_open(str(tmp_path / "tm/model.safetensors"), "pt") as ours,
        safe_open(str(tmp_path / "lc/model.safetensors"), "pt") as theirs,
    ):
        assert set(ours.keys()) == set(theirs.keys())
        name = "model.layers.0.self_attn.q_proj.weight_packed"  # same inputs (the embeddings): same algorithm
        assert (ours.get_tensor(name) == theirs.get_tensor(name)).float().mean() > 0.99
