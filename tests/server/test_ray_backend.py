"""Replicas on Ray, end to end: a real local Ray cluster of two nodes (two raylets on this host),
`tokenmill serve --backend ray --data-parallel-size 2 --ray-placement-strategy STRICT_SPREAD` placing one real
engine actor on each, serving ZeroMQ tcp:// with CURVE keys, requests through the official `openai` client, and a
replica whose process is killed mid-load while the other keeps serving and Ray restarts it.

Skipped when Ray is not installed (`pip install tokenmill[ray]`); the dev extra installs it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import zmq

from tests.cli_errors import serve_error
from tests.server.conftest import Server, free_port, start_server, start_tiny_server
from tokenmill.messages import PROTOCOL_VERSION, Hello
from tokenmill.transport.serde import encode

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

NUM_REPLICAS = 2


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray cluster of one node per replica (one CPU each), started by this test process; the server joins
    it by address."""
    from ray.cluster_utils import Cluster

    node_args = {"num_cpus": 1, "object_store_memory": 128 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
    try:
        for _ in range(NUM_REPLICAS - 1):
            cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory: pytest.TempPathFactory, ray_address: str, tiny_model_dir: Path,
               smollm2_gguf: Path) -> Iterator[Server]:  # fmt: skip
    server = start_tiny_server(
        tmp_path_factory.mktemp("ray"), tiny_model_dir, smollm2_gguf, "--backend", "ray",
        "--data-parallel-size", str(NUM_REPLICAS), "--ray-address", ray_address, "--engine-timeout", "4",
        "--ray-placement-strategy", "STRICT_SPREAD",
    )  # fmt: skip
    yield server
    assert server.stop() == 0
    log = server.log.read_text()
    assert "Traceback" not in log, log[-3000:]


def _replicas() -> dict[int, Any]:
    """The server's engine actors by index, found through Ray by their names."""
    actors = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith("tokenmill-engine-"):
            actors[int(entry["name"].rsplit("-", 1)[1])] = ray.get_actor(entry["name"], namespace=entry["namespace"])
    return actors


def _info(actor: Any) -> Any:
    return ray.get(actor.info.remote(), timeout=30)


def _per_engine(server: Server, name: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            sample, value = line.rsplit(" ", 1)
            engine = sample.split('engine="', 1)[1].split('"', 1)[0]
            values[engine] = values.get(engine, 0.0) + float(value)
    return values


def _wait_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (health := httpx.get(f"{server.url}/health", timeout=5)).json()["status"] != "ok":
        assert time.monotonic() < deadline, f"not healthy after {timeout:.0f} s: {health.text}"
        time.sleep(0.2)


def test_two_replicas_serve_over_authenticated_tcp(ray_server: Server) -> None:
    server = ray_server
    replicas = _replicas()
    assert sorted(replicas) == list(range(NUM_REPLICAS))
    infos = [_info(replicas[index]) for index in range(NUM_REPLICAS)]
    assert all(info.address.startswith("tcp://") and info.public_key for info in infos)
    assert len({info.pid for info in infos}) == NUM_REPLICAS and server.process.pid not in {i.pid for i in infos}
    assert len({info.node_id for info in infos}) == NUM_REPLICAS  # one replica per node
    before = _per_engine(server, "tokenmill:request_success_total")
    for index in range(4):
        completion = server.client.completions.create(model="tiny", prompt=f"Hello {index}", max_tokens=4,
                                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert completion.usage is not None and completion.usage.completion_tokens == 4
    chat = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, extra_body={"ignore_eos": True})  # fmt: skip
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    after = _per_engine(server, "tokenmill:request_success_total")
    served = {engine: after[engine] - before.get(engine, 0.0) for engine in after}
    assert sorted(served) == ["0", "1"] and all(count >= 2 for count in served.values()), served  # round-robin

    # A peer without the front end's key gets no answer from a replica, and the replica counts the refusal.
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(infos[0].address)
        socket.send(encode(Hello(PROTOCOL_VERSION)))
        assert not socket.poll(1000)
    finally:
        socket.close()
        context.term()
    deadline = time.monotonic() + 10
    while _per_engine(server, "tokenmill:engine_refused_connections_total").get("0", 0) < 1:
        assert time.monotonic() < deadline, "the replica did not count the refused connection"
        time.sleep(0.2)


class _Load:
    """Short completions sent back to back from a few threads; records each one's status, error code and when
    it ended."""

    def __init__(self, server: Server, num_threads: int = 3) -> None:
        self.server = server
        self.results: list[tuple[float, int, str | None]] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(num_threads)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
        with httpx.Client(timeout=60) as client:
            while not self.stopping.is_set():
                response = client.post(f"{self.server.url}/v1/completions", json=body)
                code = response.json()["error"]["code"] if response.status_code != 200 else None
                self.results.append((time.monotonic(), response.status_code, code))

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(60)


def _stream(server: Server, outcome: dict[str, Any]) -> None:
    """A long streaming completion: records its token count and the error that ended it, if any."""
    try:
        stream = server.client.completions.create(model="tiny", prompt="Tell me a story", max_tokens=1000,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                  stream_options={"include_usage": True})  # fmt: skip
        for chunk in stream:
            outcome["started"] = True
            if chunk.usage is not None:
                outcome["tokens"] = chunk.usage.completion_tokens
    except Exception as exc:  # the openai client raises the server's mid-stream error event
        outcome["error"] = str(exc)


def test_a_killed_replica_is_routed_around_and_restarted_by_ray(ray_server: Server) -> None:
    server = ray_server
    _wait_healthy(server, 60)
    replicas = _replicas()
    victim, survivor = _info(replicas[0]), _info(replicas[1])
    restarts_before = _per_engine(server, "tokenmill:engine_restarts_total")
    streams: list[dict[str, Any]] = [{}, {}]
    threads = [threading.Thread(target=_stream, args=(server, outcome), daemon=True) for outcome in streams]
    for thread in threads:  # one long stream per replica (round-robin)
        thread.start()
    deadline = time.monotonic() + 30
    while not all(outcome.get("started") for outcome in streams):
        assert time.monotonic() < deadline, streams
        time.sleep(0.05)
    load = _Load(server)
    time.sleep(0.5)
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    for thread in threads:
        thread.join(120)
    # The stream on the dead replica failed with a clear error; the one on the other replica finished whole.
    failed = [outcome for outcome in streams if "error" in outcome]
    finished = [outcome for outcome in streams if "error" not in outcome]
    assert len(failed) == 1 and len(finished) == 1, streams
    assert "engine" in failed[0]["error"] and "tokenmill-engine-0" in failed[0]["error"], failed
    assert finished[0]["tokens"] == 1000

    _wait_healthy(server, 60)
    back = time.monotonic()
    time.sleep(1)
    load.stop()
    during = [(status, code) for at, status, code in load.results if killed < at < back]
    assert sum(status == 200 for status, _ in during) >= 5, during  # the other replica served meanwhile
    assert all(status == 200 or code == "engine_unavailable" for status, code in during), during
    assert all(status == 200 for at, status, _ in load.results if at > back + 0.5)

    # Ray restarted the actor (a new process); the front end reconnected to it and routes to it again.
    restarted = _info(_replicas()[0])
    assert restarted.pid != victim.pid and restarted.node_id == victim.node_id  # in its placement group bundle
    assert _info(_replicas()[1]).pid == survivor.pid
    restarts = _per_engine(server, "tokenmill:engine_restarts_total")
    assert restarts["0"] == restarts_before.get("0", 0) + 1 and restarts["1"] == restarts_before.get("1", 0)
    before = _per_engine(server, "tokenmill:request_success_total").get("0", 0.0)
    for _ in range(4):
        completion = server.client.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0)
        assert completion.choices[0].finish_reason in ("length", "stop")
    assert _per_engine(server, "tokenmill:request_success_total")["0"] >= before + 2
    assert "engine 0 at tcp://" in server.log.read_text() and "is up again" in server.log.read_text()


def test_a_replica_that_stops_answering_is_killed_through_ray_and_restarted(ray_server: Server) -> None:
    server = ray_server
    _wait_healthy(server, 60)
    hung = _info(_replicas()[1])
    restarts_before = _per_engine(server, "tokenmill:engine_restarts_total")
    os.kill(hung.pid, signal.SIGSTOP)  # alive to Ray, silent to the front end
    try:
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{server.url}/health", timeout=5).json())["status"] == "ok":
            assert time.monotonic() < deadline, "the silent replica was never marked down"
            time.sleep(0.2)
        engines = health["engines"]
        assert [engine["status"] for engine in engines] == ["up", "down"], health
        assert "no heartbeat" in engines[1]["reason"] or "tokenmill-engine-1" in engines[1]["reason"], engines
        for _ in range(3):  # the other replica serves meanwhile
            completion = server.client.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0)
            assert completion.usage is not None and completion.usage.completion_tokens == 2
        _wait_healthy(server, 60)
    finally:
        try:
            os.kill(hung.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed through Ray, as it should be
    assert _info(_replicas()[1]).pid != hung.pid
    restarts = _per_engine(server, "tokenmill:engine_restarts_total")
    assert restarts["1"] == restarts_before.get("1", 0) + 1
    assert "restart attempt" not in server.log.read_text()  # the first attempt waited out Ray's restart


def test_a_server_without_an_address_starts_and_stops_its_own_ray_cluster(
    tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path
) -> None:
    # Given vLLM's flag for --backend, and a replica split over two shard processes (tensor parallelism).
    server = start_server(
        tmp_path, str(tiny_model_dir), "--tokenizer", str(smollm2_gguf), "--served-model-name", "tiny",
        "--num-kv-blocks", "512", "--data-parallel-backend", "ray", "--tensor-parallel-size", "2",
        model_name="tiny", env={"RAY_ADDRESS": ""},
    )  # fmt: skip
    try:
        completion = server.client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
        assert completion.usage is not None and completion.usage.completion_tokens == 3
        descendants = psutil.Process(server.process.pid).children(recursive=True)
        names = " ".join(" ".join(process.cmdline()) for process in descendants)
        assert "raylet" in names and "gcs_server" in names, "the server did not start a Ray cluster of its own"
        assert "tokenmill.parallel" in names, "the replica's second shard does not run under the cluster"
    finally:
        assert server.stop() == 0
    log = server.log.read_text()
    assert "starting a Ray cluster on this host" in log and "tensor parallelism: 2 shards" in log
    deadline = time.monotonic() + 10
    while alive := [process for process in descendants if _is_running(process)]:
        assert time.monotonic() < deadline, f"processes outlived the server: {alive}"
        time.sleep(0.2)


def _is_running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_backend_ray_without_ray_installed_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", "/nonexistent/model", "--backend", "ray"],
        capture_output=True, text=True, timeout=60, env=environment,
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert "pip install 'tokenmill[ray]'" in error


def test_backend_ray_refuses_remote_engines() -> None:
    error = serve_error("--backend", "ray", "--engine", "tcp://127.0.0.1:5555")
    assert "server.backend = 'ray'" in error and "server.engines" in error
    error = serve_error("--data-parallel-backend", "ray", "--engine", "tcp://127.0.0.1:5555")
    assert "server.backend = 'ray'" in error and "server.engines" in error
    assert "disagree" in serve_error("--data-parallel-backend", "ray", "--backend", "local")


def test_a_ray_address_nobody_answers_at_is_one_line() -> None:
    error = serve_error("--backend", "ray", "--ray-address", f"127.0.0.1:{free_port()}")
    assert "server.ray_address: no Ray cluster answers at" in error
    error = serve_error("--backend", "ray", "--ray-address", "ray://127.0.0.1:10001")
    assert "Ray Client addresses are not supported" in error


def test_the_front_end_imports_ray_only_for_backend_ray() -> None:
    # Loading the plugins registers the backend by import path; only connecting to it imports Ray.
    code = (
        "import sys, tokenmill.cli, tokenmill.server.serve, tokenmill.engine_client, tokenmill.plugin_manager as pm; "
        "pm.load_plugins().load(pm.Slot.ENGINE_BACKEND, 'ray'); print('ray' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "False"


def test_replicas_the_cluster_cannot_place_are_waited_for_until_a_signal(
    tmp_path: Path, ray_server: Server, ray_address: str, tiny_model_dir: Path, smollm2_gguf: Path
) -> None:
    # ray_server's replicas hold every CPU of the cluster, so one more replica cannot be placed. (Last in this
    # module: its actor waits under the same name as ray_server's first one, in its own namespace.) The
    # tokenizer loads while the replicas are placed: it must be there.
    log = tmp_path / "unplaced.log"
    command = [sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_model_dir), "--tokenizer", str(smollm2_gguf),
               "--device", "cpu", "--port", str(free_port()), "--backend", "ray",
               "--ray-address", ray_address]  # fmt: skip
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "waiting for the Ray cluster to place 1 replica(s) of {'CPU': 1.0} each" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert "free now:" in log.read_text()
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert "stopped while starting" in text and "Traceback" not in text and "never retrieved" not in text, text
