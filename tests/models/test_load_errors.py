"""Checkpoints that do not fit the model: one-line errors naming the file and the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.factories import save_hf_model
from tokenmill.config import load_config
from tokenmill.model_loader import load_model
from tokenmill.models.architecture import ArchitectureError
from tokenmill.weights import WeightsError


def _load(directory: Path):
    return load_model(load_config(overrides={"model": {"model": str(directory)}, "device": {"device": "cpu"}}))


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    save_hf_model("llama-tiny", tmp_path)
    return tmp_path / "model.safetensors"


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_wrong_shape_names_file_tensor_and_shapes(checkpoint: Path) -> None:
    _rewrite(checkpoint, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(100, 64)}))
    with pytest.raises(WeightsError) as excinfo:
        _load(checkpoint.parent)
    assert str(excinfo.value) == (
        f"{checkpoint}: tensor 'model.layers.1.mlp.up_proj.weight' has shape [100, 64], expected [128, 64]"
    )


def test_missing_tensor_is_named(checkpoint: Path) -> None:
    _rewrite(checkpoint, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(WeightsError, match=r"model.safetensors: missing tensors model.norm.weight$"):
        _load(checkpoint.parent)


def test_foreign_tensor_is_named(checkpoint: Path) -> None:
    _rewrite(checkpoint, lambda t: t.update({"vision_tower.patch_embed.weight": torch.zeros(2, 2)}))
    with pytest.raises(
        WeightsError, match="tensor 'vision_tower.patch_embed.weight' does not belong to LlamaForCausalLM"
    ):
        _load(checkpoint.parent)


def test_unsupported_rope_scaling_is_named(checkpoint: Path) -> None:
    config_path = checkpoint.parent / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    config_path.write_text(json.dumps(config))
    with pytest.raises(ArchitectureError, match="rope scaling type 'yarn' is not supported"):
        _load(checkpoint.parent)
