"""Engine supervision and shutdown, with real processes: a ``tokenmill serve`` on the tiny model whose engine
processes are killed with SIGKILL, and which is stopped with SIGTERM (docs/serving.md#faults-and-shutdown)."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from tests.server.conftest import Server, start_tiny_server
from tokenmill.engine_launcher import PROCESS_LABEL

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def _engines(server: Server) -> list[psutil.Process]:
    """The server's engine processes, engine 0 first."""
    children = psutil.Process(server.process.pid).children()
    engines = [child for child in children if PROCESS_LABEL in child.cmdline()]
    return sorted(engines, key=lambda engine: engine.cmdline()[-1])  # by address: engine-0.sock, engine-1.sock


def _descendants(server: Server) -> list[psutil.Process]:
    return psutil.Process(server.process.pid).children(recursive=True)


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    def running(process: psutil.Process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [process for process in processes if running(process)]


@dataclass
class _Stream:
    """A streaming completion read on a thread: when its first chunk came, how and when it ended, and how many
    tokens its usage chunk counts (0 if it ended without one)."""

    server: Server
    max_tokens: int
    prompt: str = "Tell me a long story"
    num_tokens: int = 0
    error: dict[str, str] | None = None
    status: int | None = None
    ended_at: float = 0.0
    thread: threading.Thread = field(init=False)
    first_token: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": "tiny", "prompt": self.prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.server.url}/v1/completions", json=body, timeout=120) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        self.error = event["error"]
                    elif event.get("usage"):
                        self.num_tokens = event["usage"]["completion_tokens"]
                    else:
                        self.first_token.set()
        finally:
            self.ended_at = time.monotonic()
            self.first_token.set()  # a stream refused at once has none: waiting for it must not hang

    def started(self) -> bool:
        """Wait until its first chunk came; False if it ended (or failed) first."""
        self.first_token.wait(30)
        return self.status == 200 and self.thread.is_alive()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"


def _completion(server: Server, max_tokens: int = 4, prompt: str = "Hello") -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def _wait_healthy(server: Server, timeout: float) -> list[httpx.Response]:
    """Poll /health until 200 ``ok``; returns the answers before it."""
    answers = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = httpx.get(f"{server.url}/health", timeout=5)
        if answer.status_code == 200 and answer.json()["status"] == "ok":
            return answers
        answers.append(answer)
        time.sleep(0.2)
    raise AssertionError(f"not healthy after {timeout:.0f} s: {answers[-1].text}")


def _restarts_metric(server: Server, engine: int) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("tokenmill:engine_restarts_total{") and f'engine="{engine}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no tokenmill:engine_restarts_total sample for engine {engine}")


def test_a_killed_engine_fails_its_requests_and_is_restarted(
    tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path
) -> None:
    server = start_tiny_server(tmp_path, tiny_model_dir, smollm2_gguf)
    try:
        (engine,) = _engines(server)
        streams = [_Stream(server, 1000) for _ in range(3)]
        assert all(stream.started() for stream in streams)
        engine.kill()
        killed = time.monotonic()
        for stream in streams:
            stream.join(10)
            assert stream.status == 200 and stream.error is not None, stream
            assert stream.error["code"] == "engine_unavailable" and "killed by SIGKILL" in stream.error["message"]
            assert stream.ended_at - killed < 5
        refused = _completion(server)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
        assert refused.headers["retry-after"] == "5"
        down = _wait_healthy(server, 60)
        assert down and all(answer.status_code == 503 for answer in down)
        assert down[0].json()["engines"] == [
            {"index": 0, "status": "down", "num_restarts": 0, "reason": "engine process was killed by SIGKILL"}
        ]
        served = _completion(server)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
        (restarted,) = _engines(server)
        assert restarted.pid != engine.pid and not _alive([engine])
        assert _restarts_metric(server, 0) == 1
        assert "engine 0 at ipc://" in server.log.read_text() and "is up again" in server.log.read_text()
    finally:
        assert server.stop() == 0


def test_with_two_engines_the_other_serves_while_one_restarts(
    tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path
) -> None:
    server = start_tiny_server(tmp_path, tiny_model_dir, smollm2_gguf, "--data-parallel-size", "2")
    try:
        first, second = _engines(server)
        first.kill()
        time.sleep(0.5)  # the watchdog has seen it
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert [engine["status"] for engine in health.json()["engines"]] == ["down", "up"]
        for _ in range(4):  # round-robin skips the engine that is down
            response = _completion(server)
            assert response.status_code == 200, response.text
        _wait_healthy(server, 60)
        for _ in range(2):  # and uses it again once it is back
            assert _completion(server).status_code == 200
        assert _restarts_metric(server, 0) == 1 and _restarts_metric(server, 1) == 0
        assert second.is_running() and not _alive([first])
    finally:
        assert server.stop() == 0


def test_restarts_that_keep_failing_stop_the_server_with_one_line(
    tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    server = start_tiny_server(tmp_path, model, smollm2_gguf, "--max-engine-restarts", "2")
    descendants = _descendants(server)
    for weights in model.glob("*.safetensors"):  # every restarted engine fails to load the model
        weights.unlink()
    _engines(server)[0].kill()
    status = server.process.wait(60)  # waits of 1 s and 2 s, and two failed loads
    lines = server.log.read_text().strip().splitlines()
    assert status == 1
    assert "exiting with status 1: engine 0 could not be restarted: 2 attempts in a row failed" in lines[-1]
    assert "attempt 1 failed" in server.log.read_text() and "attempt 2 failed" in server.log.read_text()
    assert not _alive(descendants)


def test_sigterm_drains_streams_refuses_new_requests_and_leaves_no_process(
    tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path
) -> None:
    server = start_tiny_server(tmp_path, tiny_model_dir, smollm2_gguf)
    streams = [_Stream(server, 600) for _ in range(4)]
    assert all(stream.started() for stream in streams)
    descendants = _descendants(server)
    assert descendants
    server.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    time.sleep(0.2)
    refused = _completion(server)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    for stream in streams:
        stream.join(60)
        assert stream.error is None and stream.num_tokens == 600  # each running request finished
        assert stream.ended_at > signalled
    assert server.process.wait(30) == 0
    assert not _alive(descendants)  # engines, and anything else the server started, are gone already


def test_a_second_sigterm_stops_at_once(tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path) -> None:
    server = start_tiny_server(tmp_path, tiny_model_dir, smollm2_gguf)
    stream = _Stream(server, 1000)
    assert stream.started()
    descendants = _descendants(server)
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert server.process.poll() is None  # draining: the stream still runs
    server.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert server.process.wait(10) == 128 + signal.SIGTERM
    assert time.monotonic() - signalled < 3
    assert not _alive(descendants)
    stream.join(10)
    assert stream.num_tokens == 0  # cut off


def _assert_kv_shipped(server: Server, prompt: str) -> None:
    """A completion of ``prompt`` succeeds, and the decode engine loads blocks the prefill engine shipped."""

    def pull_hits() -> float:
        return server.metrics().get('tokenmill:kv_tier_hits_total{tier="zmq-pull"}', 0.0)

    before = pull_hits()
    assert _completion(server, 8, prompt).status_code == 200
    deadline = time.monotonic() + 30
    while pull_hits() == before and time.monotonic() < deadline:  # the stats come with the next heartbeat
        time.sleep(0.2)
    assert pull_hits() > before


def test_disaggregated_prefill_survives_either_engine_dying(
    tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path
) -> None:
    server = start_tiny_server(tmp_path, tiny_model_dir, smollm2_gguf, "--disaggregated-prefill")
    long_prompt = "The committee reviewed the annual report on rivers, bridges and railways. " * 12
    try:
        prefill, decode = _engines(server)  # engine-0.sock, engine-1.sock
        prefill.kill()
        time.sleep(0.5)
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert _completion(server).status_code == 200  # the decode engine computes the prompt itself
        _wait_healthy(server, 60)
        _assert_kv_shipped(server, long_prompt)  # by the restarted prefill engine

        stream = _Stream(server, 1000)
        assert stream.started()
        decode.kill()
        stream.join(10)
        assert stream.error is not None and stream.error["code"] == "engine_unavailable"
        assert _completion(server).status_code == 503  # nothing decodes
        _wait_healthy(server, 60)
        _assert_kv_shipped(server, long_prompt + " Again.")  # to the restarted decode engine
    finally:
        assert server.stop() == 0


def test_an_engine_that_stops_answering_is_killed_and_restarted(
    tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path
) -> None:
    server = start_tiny_server(tmp_path, tiny_model_dir, smollm2_gguf, "--engine-timeout", "2")
    try:
        (engine,) = _engines(server)
        stream = _Stream(server, 1000)
        assert stream.started()
        engine.suspend()  # SIGSTOP: alive, silent
        stopped = time.monotonic()
        stream.join(10)
        assert stream.error is not None and "no heartbeat for 2 s" in stream.error["message"]
        assert stream.ended_at - stopped < 5
        _wait_healthy(server, 60)
        assert not _alive([engine])  # killed, not left stopped
        assert _completion(server).status_code == 200
    finally:
        assert server.stop() == 0


def test_a_remote_engine_is_connected_to_again_once_it_is_back(
    tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path
) -> None:
    import subprocess
    import sys

    from tests.server.conftest import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "tokenmill.cli", "engine", "--listen", address, str(tiny_model_dir),
               "--device", "cpu", "--num-kv-blocks", "512"]  # fmt: skip
    with (tmp_path / "engine.log").open("w") as log:
        engine = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    server = None
    try:
        server = start_tiny_server(tmp_path, tiny_model_dir, smollm2_gguf, "--engine", address, "--engine-timeout",
                                   "5", "--max-engine-restarts", "4")  # fmt: skip
        assert _completion(server).status_code == 200
        engine.kill()  # no process of its own to watch: its heartbeats stop
        engine.wait()
        deadline = time.monotonic() + 15
        while httpx.get(f"{server.url}/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)  # 5 s without a heartbeat
        assert httpx.get(f"{server.url}/health").json()["engines"][0]["status"] == "down"
        with (tmp_path / "engine-2.log").open("w") as log:
            engine = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)  # what its supervisor would do
        _wait_healthy(server, 60)
        assert _completion(server).status_code == 200
        assert _restarts_metric(server, 0) == 1
    finally:
        if server is not None:
            assert server.stop() == 0
        engine.kill()
        engine.wait()
