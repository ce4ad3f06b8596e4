"""``tokenmill bench linears`` on two carried quantized checkpoints of the same tiny model."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from tokenmill.cli import main

CHECKPOINTS = Path(__file__).parents[1] / "models" / "quantized" / "checkpoints"


def test_times_each_models_linears_against_the_first(tmp_path: Path) -> None:
    output = tmp_path / "linears.json"
    result = CliRunner().invoke(
        main,
        ["bench", "linears", "--model", str(CHECKPOINTS / "gptq-4bit-g32-sym"),
         "--compare", str(CHECKPOINTS / "ct-fp8-dynamic"), "--rows", "1,4", "--repeats", "2",
         "--output-json", str(output)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(output.read_text())
    first, second = report["models"]
    assert (first["quantizer"], second["quantizer"]) == ("gptq", "compressed-tensors")
    assert first["lm_head_quantizer"] == second["lm_head_quantizer"] == "none"  # untied: a float lm_head linear
    assert first["num_linears"] == second["num_linears"] == 8  # 2 layers x (qkv, o, gate_up, down)
    assert first["body_vs_first"] == {"1": 1.0, "4": 1.0}
    for entry in report["models"]:
        for m in ("1", "4"):
            assert entry["ms"][m]["body"] > 0 and entry["ms"][m]["lm_head"] > 0
    assert "gptq (none)" in result.output and "compressed-tensors (none)" in result.output
