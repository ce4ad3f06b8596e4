"""Fixtures shared by every test package."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF file, pulled into the cache on first use."""
    from tokenmill.model_files import pull

    return pull()
