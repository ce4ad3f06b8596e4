"""Models shared by the speculator tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.testing import save_hf_model, save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("spec") / "llama", "llama-tiny")


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A flat-ish distribution over few tokens, so a chi-square test has power with 10,000 draws. The engine
    # core needs no tokenizer.
    directory = tmp_path_factory.mktemp("spec") / "vocab16"
    save_hf_model("llama-tiny", directory, seed=3, vocab_size=16)
    return directory
