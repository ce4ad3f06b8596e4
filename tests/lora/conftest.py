"""Tiny random models with LoRA adapters made by PEFT, the reference for tokenmill's adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.factories import make_hf_model, save_tiny_model

#: Every linear tokenmill applies adapters to.
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_peft_adapter(
    directory: Path,
    base: str = "llama-tiny",
    seed: int = 1,
    base_seed: int = 0,
    base_config: dict[str, Any] | None = None,
    **lora_config: Any,
) -> Path:
    """A PEFT LoRA adapter over ``make_hf_model(base, base_seed, **base_config)``, with random A and B, large
    enough that each adapter changes greedy tokens, saved to ``directory``; ``lora_config`` overrides
    ``peft.LoraConfig`` (default: rank 8, alpha 16, every target)."""
    import torch
    from peft import LoraConfig, get_peft_model

    settings: dict[str, Any] = {"r": 8, "lora_alpha": 16, "target_modules": ALL_TARGETS, "init_lora_weights": False}
    settings.update(lora_config)
    model = get_peft_model(make_hf_model(base, base_seed, **(base_config or {})), LoraConfig(**settings))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    return directory


def peft_model(base: str, adapter: Path, base_seed: int = 0) -> Any:
    """The base model with ``adapter`` loaded by PEFT, float32, eval mode: the reference forward."""
    from peft import PeftModel

    return PeftModel.from_pretrained(make_hf_model(base, base_seed), str(adapter)).eval()


@pytest.fixture(scope="session")
def lora_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (seed 0) the adapters below were made for, with its tokenizer."""
    return save_tiny_model(tmp_path_factory.mktemp("lora-base"))


@pytest.fixture(scope="session")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Five adapters over ``lora_model_dir``'s model: ranks 8, 4, 16 (rsLoRA), one with per-module ranks and
    alphas on attention only, and one on the MLP only."""
    root = tmp_path_factory.mktemp("adapters")
    configs: list[dict[str, Any]] = [
        {},
        {"r": 4, "lora_alpha": 8},
        {"r": 16, "lora_alpha": 8, "use_rslora": True},
        {
            "target_modules": ["q_proj", "v_proj", "o_proj"],
            "rank_pattern": {"v_proj": 2},
            "alpha_pattern": {"o_proj": 4},
        },
        {"r": 6, "lora_alpha": 12, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    ]
    return [save_peft_adapter(root / f"adapter{i}", seed=10 + i, **c) for i, c in enumerate(configs)]
