"""Authenticated engines, end to end: a real `tokenmill engine` on tcp:// with CURVE keys, a real `tokenmill serve
--engine` holding the front end's keys, a peer without keys that gets nothing, and an authenticated peer that
sends thousands of fuzzed frames, after which the engine still serves a real request and counts what it dropped.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.auth

from tests.server.conftest import Server, free_port, start_tiny_server
from tokenmill.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStatsMessage,
    Hello,
    Ready,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.transport.serde import encode

pytestmark = pytest.mark.multiproc

_MAX_MESSAGE_SIZE = 64 * 1024


def _certificates(directory: Path) -> dict[str, Path]:
    paths: dict[str, Path] = {}
    for name in ("engine", "frontend"):
        public, secret = zmq.auth.create_certificates(directory / name, name)
        paths[name], paths[f"{name}_secret"] = Path(public), Path(secret)
    allowed = directory / "allowed"
    allowed.mkdir()
    (allowed / "frontend.key").write_bytes(paths["frontend"].read_bytes())
    paths["allowed"] = allowed
    return paths


@pytest.fixture(scope="module")
def secured(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, smollm2_gguf: Path
) -> Iterator[tuple[Server, subprocess.Popen[bytes], str, dict[str, Path]]]:
    """(server, engine process, engine address, certificate paths)."""
    directory = tmp_path_factory.mktemp("curve")
    for name in ("engine", "frontend"):
        (directory / name).mkdir()
    paths = _certificates(directory)
    address = f"tcp://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "tokenmill.cli", "engine", "--listen", address, str(tiny_model_dir),
               "--device", "cpu", "--num-kv-blocks", "512", "--curve-secret-key-file", str(paths["engine_secret"]),
               "--curve-public-keys-dir", str(paths["allowed"]), "--max-message-size", "64KiB"]  # fmt: skip
    with (directory / "engine.log").open("w") as log:
        engine = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    server = None
    try:
        server = start_tiny_server(
            directory, tiny_model_dir, smollm2_gguf, "--engine", address,
            "--curve-secret-key-file", str(paths["frontend_secret"]),
            "--curve-engine-public-key-file", str(paths["engine"]),
        )  # fmt: skip
        yield server, engine, address, paths
    finally:
        if server is not None:
            server.stop()
        engine.kill()
        engine.wait()


def _complete(server: Server) -> str:
    completion = server.client.completions.create(model=server.model, prompt="Hello there", max_tokens=4, temperature=0)
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    return completion.choices[0].text


def _wait_for_metric(server: Server, name: str, minimum: float, timeout: float = 10.0) -> dict[str, float]:
    """/metrics once ``name`` reaches ``minimum`` (engines report with their heartbeats, every 0.5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = server.metrics()
        if samples.get(name, 0.0) >= minimum or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def test_the_authenticated_front_end_is_served(secured: tuple[Server, Any, str, dict[str, Path]]) -> None:
    server, engine, _, _ = secured
    assert isinstance(_complete(server), str)
    assert engine.poll() is None


def test_a_peer_without_the_keys_gets_nothing(secured: tuple[Server, Any, str, dict[str, Path]]) -> None:
    server, engine, address, paths = secured
    context = zmq.Context()
    try:
        plain = context.socket(zmq.DEALER)  # no CURVE at all
        stranger = context.socket(zmq.DEALER)  # CURVE with a key the engine does not list
        stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
        stranger.curve_serverkey = zmq.auth.load_certificate(paths["engine"])[0]
        for socket in (plain, stranger):
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            socket.send(encode(Hello(PROTOCOL_VERSION)))
        time.sleep(2.0)
        assert plain.poll(0) == 0 and stranger.poll(0) == 0  # no Ready, no heartbeat: not a peer of the engine
    finally:
        context.destroy(linger=0)
    samples = _wait_for_metric(server, "tokenmill:engine_refused_connections_total", 2)
    assert samples["tokenmill:engine_refused_connections_total"] >= 2
    assert engine.poll() is None
    assert isinstance(_complete(server), str)


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.randint(-(2**63), 2**64 - 1)
    if kind == 1:
        return rng.random() * 10 ** rng.randint(-5, 30) * rng.choice((1, -1))
    if kind == 2:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.randbytes(rng.randrange(16))
    if kind == 4:
        return rng.choice((None, True, False))
    if kind == 5:
        return rng.choice(("EngineCoreRequest", "AbortRequests", "Hello", "Ready", "EngineCoreOutputs"))
    if kind in (6, 7):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(8))]
    return {str(_random_value(rng, depth + 1)): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _valid_frames() -> list[bytes]:
    request = EngineCoreRequest("fuzz", [1, 2, 3, 4], SamplingParams(max_tokens=2), [0], 0.0)
    return [encode(request), encode(AbortRequests(["fuzz", "nobody"])), encode(Hello(PROTOCOL_VERSION))]


def _wrong_type_frames() -> list[bytes]:
    """Well-formed msgpack of messages an engine never takes (they go the other way)."""
    stats = EngineStatsMessage(0, 0, 0.0, 0, 0, 0, 0, 0)
    return [encode(EngineCoreOutputs([EngineCoreOutput("x", [1])], stats)), encode(Ready(1, "/m", 8, 1)), b"\xc0", b""]


def _fuzzed_frames(rng: random.Random, count: int) -> list[bytes]:
    frames = []
    valid = _valid_frames()
    for _ in range(count):
        kind = rng.randrange(4)
        if kind == 0:  # noise
            frames.append(rng.randbytes(rng.randrange(1, 300)))
        elif kind == 1:  # valid msgpack, random shape (tags included, so some reach the typed decoder's fields)
            if rng.random() < 0.5:
                tag = rng.choice(("EngineCoreRequest", "AbortRequests", "Hello"))
                value = [tag, *(_random_value(rng, 1) for _ in range(rng.randrange(9)))]
            else:
                value = _random_value(rng)
            frames.append(msgspec.msgpack.encode(value))
        else:  # a real message, mutated: bytes flipped, cut short, or grown
            frame = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                position = rng.randrange(len(frame))
                operation = rng.randrange(3)
                if operation == 0:
                    frame[position] = rng.randrange(256)
                elif operation == 1:
                    del frame[position:]
                    if not frame:
                        frame.append(rng.randrange(256))
                else:
                    frame[position:position] = rng.randbytes(rng.randrange(1, 9))
            frames.append(bytes(frame))
    return frames


def test_fuzzed_frames_never_crash_the_engine(secured: tuple[Server, Any, str, dict[str, Path]]) -> None:
    server, engine, address, paths = secured
    before = server.metrics()
    text_before = _complete(server)
    rng = random.Random(15)
    fuzzed = _fuzzed_frames(rng, 3000)
    certain = _wrong_type_frames()
    context = zmq.Context()
    try:
        fuzzer = context.socket(zmq.DEALER)  # authenticated: holds the front end's keys, so it gets past CURVE
        fuzzer.setsockopt(zmq.LINGER, 0)
        fuzzer.curve_publickey, fuzzer.curve_secretkey = zmq.auth.load_certificate(paths["frontend_secret"])
        fuzzer.curve_serverkey = zmq.auth.load_certificate(paths["engine"])[0]
        fuzzer.connect(address)
        for frame in [*certain, *fuzzed]:
            fuzzer.send(frame)
        fuzzer.send(b"\x93" + b"x" * (_MAX_MESSAGE_SIZE + 1000))  # over the limit, under ZeroMQ's 2x cap
        fuzzer.send_multipart([encode(Hello(PROTOCOL_VERSION)), b"second part"])
        time.sleep(1.0)
    finally:
        context.destroy(linger=0)
    name = 'tokenmill:engine_dropped_messages_total{reason="%s"}'
    samples = _wait_for_metric(server, name % "multipart", before.get(name % "multipart", 0) + 1)
    assert engine.poll() is None, "the engine died"
    dropped = {reason: samples.get(name % reason, 0) - before.get(name % reason, 0)
               for reason in ("malformed", "oversized", "multipart")}  # fmt: skip
    assert dropped["oversized"] == 1 and dropped["multipart"] == 1
    # Every frame that is not a message of the engine's types is counted, the wrong-type ones for sure; mutated
    # real messages that still decode are served (or refused as requests), not counted.
    assert len(certain) <= dropped["malformed"] <= len(certain) + len(fuzzed)
    assert dropped["malformed"] > len(fuzzed) // 2
    # And the engine still serves, the same greedy text as before.
    assert _complete(server) == text_before


def test_a_front_end_the_engine_refuses_says_so_at_once(
    secured: tuple[Server, Any, str, dict[str, Path]], tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path
) -> None:
    """A front end started with a key the engine does not list exits within seconds naming the refusal, instead
    of waiting out the engine start timeout (600 s) as if no engine were there."""
    _, engine, address, paths = secured
    (tmp_path / "stranger").mkdir()
    _, stranger_secret = zmq.auth.create_certificates(tmp_path / "stranger", "stranger")
    command = [sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_model_dir), "--tokenizer", str(smollm2_gguf),
               "--port", "0", "--engine", address, "--curve-secret-key-file", stranger_secret,
               "--curve-engine-public-key-file", str(paths["engine"])]  # fmt: skip
    started = time.monotonic()
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert finished.returncode != 0
    assert f"engine at {address} refused the connection: the engine does not allow this front end's key" in (
        finished.stderr
    ), finished.stderr
    assert time.monotonic() - started < 60
    assert "Traceback" not in finished.stderr
    assert engine.poll() is None
