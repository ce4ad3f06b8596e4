"""Real ``tokenmill serve`` subprocesses on free loopback ports, for tests that go through HTTP."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    import openai

logger = logging.getLogger(__name__)

__all__ = ["TokenmillServer", "free_port", "start_server"]


def free_port() -> int:
    """A loopback TCP port that is free now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class TokenmillServer:
    """A running ``tokenmill serve`` process: its ``url``, the ``model`` name it serves and its ``log``."""

    process: subprocess.Popen[str]
    url: str
    model: str
    log: Path
    api_key: str | None = None
    _client: Any = field(default=None, repr=False)

    @property
    def client(self) -> openai.OpenAI:
        """An ``openai.OpenAI`` client for this server (``openai`` is a test-only dependency)."""
        if self._client is None:
            import openai

            self._client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0)
        return self._client

    def metrics(self) -> dict[str, float]:
        """/metrics samples summed over engines, keyed by name plus their labels but ``engine`` and
        ``model_name`` (``tokenmill:kv_tier_hits_total{tier="disk"}``, ``tokenmill:num_requests_running``)."""
        text = httpx.get(f"{self.url}/metrics").text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, value = line.rsplit(" ", 1)
            base, _, labels = name.partition("{")
            dropped = ("engine=", "model_name=")
            kept = [label for label in labels.rstrip("}").split(",") if label and not label.startswith(dropped)]
            name = f"{base}{{{','.join(kept)}}}" if kept else base
            samples[name] = samples.get(name, 0.0) + float(value)
        return samples

    def stop(self) -> int:
        """Terminate the server (SIGTERM, then SIGKILL after 60 s); returns its exit status."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self._client is not None:
            self._client.close()
        return self.process.wait()


def start_server(
    log_dir: Path,
    *args: str,
    model_name: str | None = None,
    env: Mapping[str, str] | None = None,
    api_key: str | None = None,
    timeout_s: float = 180.0,
) -> TokenmillServer:
    """Start ``tokenmill serve ARGS --port PORT --device cpu`` and wait until /health answers 200.

    :param args: the model and any other flags (``--api-key`` is added from ``api_key``).
    :param model_name: the name the server serves the model under; default: the first of /v1/models.
    :param env: variables added to this process's environment (``PYTHONPATH``, ``TOKENMILL_PLUGINS``, ...).
    :raises RuntimeError: with the end of the server's log, if it exits or is not healthy in ``timeout_s``.
    """
    port = free_port()
    log = log_dir / f"server-{port}.log"
    command = [sys.executable, "-m", "tokenmill.cli", "serve", *args, "--port", str(port), "--device", "cpu"]
    if api_key is not None:
        command += ["--api-key", api_key]
    environment = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, text=True, env=environment)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                logger.info("tokenmill serve on %s (log: %s)", url, log)
                return TokenmillServer(process, url, model_name or _served_model(url, api_key), log, api_key)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    process.wait()
    raise RuntimeError(f"server did not become healthy in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def _served_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    name: str = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
    return name
