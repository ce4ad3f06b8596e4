"""load_model: every slot resolved from the config; dtype, threads and format selection."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.factories import save_hf_model
from tokenmill.config import load_config
from tokenmill.model_loader import load_model
from tokenmill.weights import WeightsError


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bf16")
    save_hf_model("qwen3-tiny", directory, dtype=torch.bfloat16)
    return directory


def _config(directory: Path, **sections):
    return load_config(overrides={"model": {"model": str(directory)}, "device": {"device": "cpu"}, **sections})


def test_auto_dtype_is_float32_on_cpu_even_for_a_bf16_checkpoint(bf16_checkpoint: Path) -> None:
    loaded = load_model(_config(bf16_checkpoint))
    assert loaded.dtype == torch.float32
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    assert loaded.arch.torch_dtype == "bfloat16"


def test_explicit_dtype_is_honoured(bf16_checkpoint: Path) -> None:
    loaded = load_model(load_config(overrides={"model": {"model": str(bf16_checkpoint), "dtype": "bfloat16"}}))
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_num_threads_is_applied(bf16_checkpoint: Path) -> None:
    before = torch.get_num_threads()
    try:
        load_model(_config(bf16_checkpoint, device={"device": "cpu", "num_threads": 1}))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_named_weight_format_that_cannot_read_the_path(bf16_checkpoint: Path) -> None:
    config = load_config(overrides={"model": {"model": str(bf16_checkpoint), "weight_format": "gguf"}})
    with pytest.raises(WeightsError, match="not a GGUF file"):
        load_model(config)


def test_path_no_format_recognises(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(WeightsError, match="no installed weight format recognises it"):
        load_model(_config(tmp_path))
