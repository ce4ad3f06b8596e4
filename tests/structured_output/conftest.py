"""A tiny random model with its own byte-level tokenizer, shared by the structured-output tests.

Unmasked at temperature 1.0 it writes bytes at random, so an output that parses and validates is the mask's doing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.testing import save_tiny_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("structured") / "llama", "llama-tiny")
