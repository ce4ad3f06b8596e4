"""The GPU tests' tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.testing.factories import save_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with one head of 64: a head size the Triton kernels take, so "auto" picks them."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", num_attention_heads=1, num_key_value_heads=1)
