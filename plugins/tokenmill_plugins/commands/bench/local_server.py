"""A real ``tokenmill serve`` subprocess on a free loopback port, for the comparison suite.

``start_local_server`` writes the engine config to a TOML file, starts
``python -m tokenmill.cli serve --config FILE`` with its output in a log file,
and waits for ``GET /health``. If the server exits (or never becomes healthy),
it logs the tail of the server's log and raises ``ServerStartError`` with the
log's last line. Only ``bench.suite`` starts servers; this module imports no torch.
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec

from tokenmill.config import EngineConfig
from tokenmill.errors import TokenmillError

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.3
_STOP_TIMEOUT_S = 60.0
_LOG_TAIL_LINES = 40


class ServerStartError(TokenmillError):
    """The ``tokenmill serve`` subprocess exited or never became healthy; the log's tail was logged."""


@dataclass
class LocalServer:
    """A running ``tokenmill serve`` subprocess; ``stop`` ends it."""

    process: subprocess.Popen[bytes]
    url: str  # http://127.0.0.1:PORT
    log_path: Path
    api_key: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """``GET /metrics`` as {sample name: value}, summed over labels (engines, models, buckets)."""
        response = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10)
        response.raise_for_status()
        samples: dict[str, float] = {}
        for line in response.text.splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0]
            samples[name] = samples.get(name, 0.0) + float(value)
        return samples

    def log_summary(self) -> str:
        """Log the tail of the server's log and return its most telling line (see ``_last_line``)."""
        return _last_line(self.log_path, log_tail=True)

    def check_alive(self, during: str) -> None:
        """Raise ``ServerStartError`` if the process has exited; called after each measured run."""
        if self.process.poll() is not None:
            raise ServerStartError(
                f"tokenmill serve exited with status {self.process.returncode} during {during}: "
                f"{_last_line(self.log_path, log_tail=True)}"
            )

    def stop(self) -> int:
        """SIGTERM (the server drains), then SIGKILL after a minute; returns the exit status."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "tokenmill serve (pid %d) did not stop in %.0f s; killing it", self.process.pid, _STOP_TIMEOUT_S
                )
                self.process.kill()
        return self.process.wait()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may still take it before the server does)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_local_server(config: EngineConfig, work_dir: Path, *, timeout_s: float = 600.0) -> LocalServer:
    """Start ``tokenmill serve`` with ``config`` on a free loopback port and wait until it is healthy.

    ``config.server.host`` and ``port`` are replaced (127.0.0.1 and a free port);
    everything else reaches the server as given. The config file and the log go
    to ``work_dir``. Raises ``ServerStartError`` when the server exits first or is
    not healthy within ``timeout_s`` (model loading included).
    """
    port = free_port()
    config = msgspec.structs.replace(config, server=msgspec.structs.replace(config.server, host="127.0.0.1", port=port))
    config_path = work_dir / f"server-{port}.toml"
    config_path.write_text(config.to_toml())
    log_path = work_dir / f"server-{port}.log"
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--config", str(config_path)]
    logger.info("starting %s (log: %s)", " ".join(command), log_path)
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    server = LocalServer(process, f"http://127.0.0.1:{port}", log_path, config.server.api_key)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(
                f"tokenmill serve exited with status {process.returncode} before it was healthy: "
                f"{_last_line(log_path, log_tail=True)}"
            )
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                logger.info("tokenmill serve is healthy at %s (pid %d)", server.url, process.pid)
                return server
        except httpx.HTTPError:
            pass
        time.sleep(_POLL_INTERVAL_S)
    server.stop()
    raise ServerStartError(
        f"tokenmill serve was not healthy after {timeout_s:.0f} s (raise --server-timeout): "
        f"{_last_line(log_path, log_tail=True)}"
    )


@contextmanager
def local_server(config: EngineConfig, work_dir: Path, *, timeout_s: float = 600.0) -> Iterator[LocalServer]:
    """``start_local_server`` as a context manager that always stops the server."""
    server = start_local_server(config, work_dir, timeout_s=timeout_s)
    try:
        yield server
    finally:
        status = server.stop()
        logger.info("tokenmill serve stopped (status %d)", status)


def _last_line(log_path: Path, *, log_tail: bool) -> str:
    """The log's most telling line for a one-line error: the last exception line of a traceback
    (``ModelNotFoundError: ...``), else the last non-empty line. With ``log_tail`` the tail is logged too."""
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return f"(no log at {log_path})"
    if log_tail and lines:
        logger.error("last lines of the tokenmill serve log %s:\n%s", log_path, "\n".join(lines[-_LOG_TAIL_LINES:]))
    for line in reversed(lines):
        if match := _EXCEPTION_LINE.match(line):
            return f"{match.group(1)}: {match.group(2)}"
    return lines[-1] if lines else "(the log is empty)"


# "tokenmill.model_files.ModelNotFoundError: model 'x' not found": the exception's name and message.
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception)): (.+)$")
