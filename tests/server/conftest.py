"""Real `tokenmill serve` subprocesses on free loopback ports, for the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.factories import save_hf_model

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen[str]
    url: str
    model: str
    log: Path

    def metrics(self) -> dict[str, float]:
        """Unlabelled-by-engine samples of /metrics, keyed by name plus labels, summed over engines."""
        text = httpx.get(f"{self.url}/metrics").text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, value = line.rsplit(" ", 1)
            if 'engine="' in name:
                name = name.split("{")[0]
            samples[name] = samples.get(name, 0.0) + float(value)
        return samples

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def start_server(tmp_path: Path, *args: str, model_name: str) -> Server:
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    command = [sys.executable, "-m", "tokenmill.cli", "serve", *args, "--port", str(port), "--device", "cpu"]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return Server(process, url, model_name, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()[-3000:]}")


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
    """A tiny random Llama with the default model's vocabulary size, so its tokenizer fits."""
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
