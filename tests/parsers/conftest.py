from __future__ import annotations

from pathlib import Path

import pytest

from tests.parsers.models import save_qwen_like_model
from tokenmill.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def qwen_like_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_qwen_like_model(tmp_path_factory.mktemp("qwen-like") / "model")


@pytest.fixture(scope="session")
def tokenizer(qwen_like_model: Path) -> Tokenizer:
    return Tokenizer.from_path(qwen_like_model)
