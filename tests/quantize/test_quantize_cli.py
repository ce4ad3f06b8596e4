"""``tokenmill quantize`` end to end on a tiny random model: the checkpoint is llm-compressor's format
(config and tensor names), loads in transformers, and computes nearly what the float model does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from tokenmill_plugins.commands.quantize.schemes import make_scheme

from tests.factories import save_tiny_model
from tokenmill.cli import main

pytest.importorskip("compressed_tensors")

#: Largest mean |logit difference| / mean |logit| from the float model on random tokens: measured 0.41, 0.33,
#: 0.088 and 0.028 (a random tiny model amplifies rounding far more than a trained one).
_MAX_RELATIVE_ERROR = {"gptq": 0.6, "awq": 0.5, "fp8": 0.15, "int8": 0.05}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny"), "llama-tiny", seed=5, hidden_size=128, intermediate_size=256
    )


def _quantize(model: Path, output: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        main,
        ["quantize", str(model), "--output", str(output), "--seq-len", "64", "--num-samples", "8", "--no-progress",
         "--device", "cpu", *args],
    )  # fmt: skip
    return result.exit_code, result.output


def _load(directory: Path, decompress: bool = False) -> object:
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    kwargs = {"quantization_config": CompressedTensorsConfig(run_compressed=False)} if decompress else {}
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8", "int8"])
def test_output_loads_in_transformers_and_stays_close(tiny_model: Path, tmp_path: Path, method: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    output = tmp_path / method
    exit_code, text = _quantize(tiny_model, output, "--method", method)
    assert exit_code == 0, text

    config = json.loads((output / "config.json").read_text())
    expected = make_scheme(method).quantization_config(["lm_head"])
    assert config["quantization_config"] == expected
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {p.name for p in output.iterdir()}

    from safetensors import safe_open

    with safe_open(str(output / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    prefix = "model.layers.1.self_attn.k_proj"
    if method in ("gptq", "awq"):
        assert {f"{prefix}.weight_packed", f"{prefix}.weight_scale", f"{prefix}.weight_shape"} <= names
        assert (f"{prefix}.weight_zero_point" in names) == (method == "awq")
    else:
        assert {f"{prefix}.weight", f"{prefix}.weight_scale"} <= names
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names  # left in float

    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    # transformers 5.24 refuses asymmetric pack-quantized checkpoints unless told to decompress them at load
    # (the packed zero points fail its shape check): llm-compressor's own W4A16_ASYM output does the same.
    quantized = _load(output, decompress=method == "awq")
    input_ids = torch.randint(3, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected_logits = reference(input_ids).logits
        logits = quantized(input_ids).logits  # type: ignore[operator]
    relative = float((logits - expected_logits).abs().mean() / expected_logits.abs().mean())
    assert 0 < relative < _MAX_RELATIVE_ERROR[method]


def test_gptq_is_closer_than_round_to_nearest(tiny_model: Path, tmp_path: Path) -> None:
    """On the calibration text itself GPTQ's output error is below round to nearest with the same scales
    (llm-compressor's W4A16 stored by QuantizationModifier would be the latter)."""
    import torch
    from tokenmill_plugins.commands.quantize.calibration import calibration_samples, default_calibration_text
    from transformers import AutoModelForCausalLM

    from tokenmill.tokenizer import Tokenizer

    errors = {}
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    samples = calibration_samples(Tokenizer.from_path(tiny_model), default_calibration_text(), 8, 64)
    input_ids = torch.tensor(samples)
    for name, args in {"gptq": ["--method", "gptq"], "rtn": ["--method", "gptq", "--dampening", "1e9"]}.items():
        # an overwhelming dampening makes the Hessian a multiple of the identity: GPTQ becomes round to nearest
        exit_code, text = _quantize(tiny_model, tmp_path / name, *args)
        assert exit_code == 0, text
        with torch.no_grad():
            errors[name] = float((_load(tmp_path / name)(input_ids).logits - reference(input_ids).logits).pow(2).mean())  # type: ignore[operator]
    assert errors["gptq"] < 0.9 * errors["rtn"], errors


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "gptq5"], "Error: unknown method 'gptq5': choose one of gptq, awq, fp8, int8"),
        (["--method", "gptq", "--group-size", "96"], "Error: model.layers.0.self_attn.qkv_proj: 128 input features"),
        (["--method", "awq", "--group-size", "12"], "Error: --group-size 12"),
        (["--method", "gptq", "--seq-len", "100000"], "Error: the calibration text has"),
    ],
)
def test_errors_are_one_line(tiny_model: Path, tmp_path: Path, args: list[str], message: str) -> None:
    exit_code, text = _quantize(tiny_model, tmp_path / "out", *args)
    assert exit_code != 0
    assert message in text and "Traceback" not in text, text
    assert len([line for line in text.splitlines() if line.startswith("Error")]) == 1


def test_missing_model_and_existing_output(tmp_path: Path, tiny_model: Path) -> None:
    exit_code, text = _quantize(tmp_path / "missing", tmp_path / "out", "--method", "fp8")
    assert exit_code != 0 and "Error: model" in text and "not found" in text
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("x")
    exit_code, text = _quantize(tiny_model, tmp_path / "full", "--method", "fp8")
    assert exit_code != 0 and "is not an empty directory" in text
