"""Real `tokenmill serve` subprocesses on free loopback ports, for the server tests (through the test kit)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.factories import save_hf_model
from tokenmill.testing.server import TokenmillServer as Server
from tokenmill.testing.server import free_port, start_server

__all__ = ["API_KEY", "Server", "free_port", "start_server", "start_tiny_server"]

API_KEY = "test-key"


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Iterator[Server]:
    """The default model, behind an API key, with a small KV budget."""
    server = start_server(
        tmp_path_factory.mktemp("default"), "--api-key", API_KEY, "--kv-cache-memory", "256MiB",
        model_name="SmolLM2-135M-Instruct-Q4_1",
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the default model's vocabulary size, so its tokenizer fits (here it takes
    the place of the test kit's ``tiny_model_dir``, which has a tokenizer of its own)."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_hf_model("llama-tiny", directory, vocab_size=49152)
    return directory


def start_tiny_server(tmp_path: Path, model_dir: Path, tokenizer: Path, *args: str) -> Server:
    return start_server(
        tmp_path, str(model_dir), "--tokenizer", str(tokenizer), "--served-model-name", "tiny",
        "--num-kv-blocks", "2048", *args, model_name="tiny",
    )  # fmt: skip


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, smollm2_gguf: Path) -> Iterator[Server]:
    """A tiny model: 64 running requests at most and no waiting room, so request 65 gets 429."""
    server = start_tiny_server(
        tmp_path_factory.mktemp("tiny"), tiny_model_dir, smollm2_gguf, "--max-num-seqs", "64", "--max-waiting", "0"
    )
    yield server
    server.stop()
