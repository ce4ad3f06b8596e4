"""Fixtures shared by every test package."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_WEIGHT_CACHE = "TOKENMILL_WEIGHT_CACHE_DIR"


def pytest_configure(config: pytest.Config) -> None:
    # Quantized models that tests load (and the servers they start, which inherit the environment) cache
    # their repacked weights in a folder of this run, removed at its end, not in ~/.cache/tokenmill/weights.
    if _WEIGHT_CACHE not in os.environ:
        config.stash[_weight_cache_key] = os.environ[_WEIGHT_CACHE] = tempfile.mkdtemp(prefix="tokenmill-weights-")


def pytest_unconfigure(config: pytest.Config) -> None:
    directory = config.stash.get(_weight_cache_key, None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
        del os.environ[_WEIGHT_CACHE]


_weight_cache_key = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF file, pulled into the cache on first use."""
    from tokenmill.model_files import pull

    return pull()
