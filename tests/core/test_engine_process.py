"""The engine process's message pump (``_EngineServer``) with a fake engine and a fake endpoint: the
handshake, which front end gets which outputs, when a request's owner is forgotten, and the stats read once
per round of messages."""

from __future__ import annotations

import ast
import importlib
import inspect
from collections import deque
from types import SimpleNamespace
from typing import Any

from tokenmill.engine_launcher import _BOOTSTRAP
from tokenmill.engine_process import IDLE_BEFORE_PREPARE_S, _EngineServer, _IdleWatch
from tokenmill.messages import (
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStatsMessage,
    Hello,
    Ready,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.transport.base import EngineEndpoint
from tokenmill.transport.serde import decode_from_engine, encode


class _FakeEndpoint(EngineEndpoint):
    def __init__(self) -> None:
        self.inbox: deque[tuple[bytes, bytes]] = deque()
        self.sent: list[tuple[bytes, Any]] = []

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.inbox)

    def recv(self) -> tuple[bytes, bytes] | None:
        return self.inbox.popleft() if self.inbox else None

    def send(self, peer: bytes, frame: bytes) -> None:
        self.sent.append((peer, decode_from_engine(frame)))

    def close(self) -> None:
        pass

    def take(self) -> list[tuple[bytes, Any]]:
        sent, self.sent = self.sent, []
        return sent


class _FakeEngine:
    def __init__(self) -> None:
        self.loaded = SimpleNamespace(path="/models/x")
        self.max_model_len = 256
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=8))
        self.layout = SimpleNamespace(block_size=32)
        self.kv_cache_hash_salt = "x:float32"
        self.request_ids: list[str] = []
        self.num_steps = 0
        self.num_stats_calls = 0
        # What take_prefix_cache_delta hands out next: the hashes the prefix cache gained and lost.
        self.prefix_delta: tuple[list[bytes], list[bytes]] = ([], [])

    def add_request(self, message: EngineCoreRequest) -> None:
        if not message.prompt_token_ids:
            raise ValueError("empty prompt")
        self.request_ids.append(message.request_id)

    def stats(self) -> EngineStatsMessage:
        self.num_stats_calls += 1
        return EngineStatsMessage(self.num_stats_calls, 0, 0.0, 0, 0, 0, 0, 0)

    def take_prefix_cache_delta(self) -> tuple[list[bytes], list[bytes]]:
        delta, self.prefix_delta = self.prefix_delta, ([], [])
        return delta


def _server() -> tuple[_EngineServer, _FakeEndpoint]:
    endpoint = _FakeEndpoint()
    return _EngineServer(_FakeEngine(), endpoint), endpoint


def _request(request_id: str, n: int = 1, prompt_token_ids: list[int] | None = None) -> bytes:
    prompt = [1, 2, 3] if prompt_token_ids is None else prompt_token_ids
    return encode(EngineCoreRequest(request_id, prompt, SamplingParams(n=n), [0], 0.0))


def test_hello_gets_ready_with_the_prefix_cache_hashing() -> None:
    server, endpoint = _server()
    endpoint.inbox.append((b"front-end", encode(Hello(PROTOCOL_VERSION))))
    server.receive(timeout_ms=0)
    [(peer, ready)] = endpoint.take()
    assert peer == b"front-end"
    assert isinstance(ready, Ready)
    assert (ready.error, ready.block_size, ready.hash_salt, ready.max_model_len) == (None, 32, "x:float32", 256)


def test_outputs_go_to_their_owner_until_the_request_finishes() -> None:
    server, endpoint = _server()
    endpoint.inbox.extend([(b"a", _request("r1", n=2)), (b"b", _request("r2"))])
    server.receive(timeout_ms=0)
    # Completion 0 of r1 finishes first: r1 stays owned until the scheduler says all of it is done.
    server.send_outputs([
        EngineCoreOutput("r1", [5], finish_reason="length"),
        EngineCoreOutput("r1#1", [6], parent_id="r1", index=1),
        EngineCoreOutput("r2", [7]),
    ])  # fmt: skip
    sent = {peer: message.outputs for peer, message in endpoint.take()}
    assert [o.request_id for o in sent[b"a"]] == ["r1", "r1#1"]
    assert [o.request_id for o in sent[b"b"]] == ["r2"]
    assert set(server.owners) == {"r1", "r2"}
    server.send_outputs(
        [EngineCoreOutput("r1#1", [8], finish_reason="length", parent_id="r1", index=1, request_finished=True)]
    )
    [(peer, message)] = endpoint.take()
    assert peer == b"a" and message.outputs[0].request_finished
    assert set(server.owners) == {"r2"}
    server.send_outputs([EngineCoreOutput("r1", [9])])  # nobody owns it any more: dropped
    assert endpoint.take() == []


def test_a_refused_request_is_answered_finished_and_not_owned() -> None:
    server, endpoint = _server()
    endpoint.inbox.append((b"a", _request("bad", prompt_token_ids=[])))
    server.receive(timeout_ms=0)
    [(peer, message)] = endpoint.take()
    assert isinstance(message, EngineCoreOutputs)
    [refusal] = message.outputs
    assert (refusal.finish_reason, refusal.error, refusal.request_finished) == ("abort", "empty prompt", True)
    assert server.owners == {}


def test_a_malformed_frame_is_dropped() -> None:
    server, endpoint = _server()
    endpoint.inbox.extend([(b"a", b"\xff not msgpack"), (b"a", _request("r1"))])
    server.receive(timeout_ms=0)
    assert server.engine.request_ids == ["r1"]


def test_oversized_and_malformed_frames_are_dropped_counted_and_reported() -> None:
    endpoint = _FakeEndpoint()
    server = _EngineServer(_FakeEngine(), endpoint, max_message_size=64)
    bad_utf8 = b"\x92\xa2\xff\xfe\x01"  # a tag that is not UTF-8: msgspec raises UnicodeDecodeError, not DecodeError
    endpoint.inbox.extend([(b"a", b"\xff not msgpack"), (b"a", bad_utf8), (b"a", _request("big" * 30)),
                           (b"a", _request("r1"))])  # fmt: skip
    server.receive(timeout_ms=0)
    assert server.engine.request_ids == ["r1"]
    server.send_outputs([EngineCoreOutput("r1", [5])])  # every batch and heartbeat carries the counts
    [(_, message)] = endpoint.take()
    assert message.stats.num_dropped_messages == {"malformed": 2, "oversized": 1}
    assert message.stats.num_refused_connections == 0


def _hash(number: int) -> bytes:
    return number.to_bytes(4, "little") * 8  # a 32-byte block hash; its summary key is its first 8 bytes


def _key(number: int) -> bytes:
    return _hash(number)[:8]


def _hello(server: _EngineServer, endpoint: _FakeEndpoint, peer: bytes) -> None:
    endpoint.inbox.append((peer, encode(Hello(PROTOCOL_VERSION))))
    server.receive(timeout_ms=0)
    endpoint.take()  # the Ready


def test_each_front_end_gets_a_snapshot_after_hello_then_its_own_deltas() -> None:
    server, endpoint = _server()
    engine = server.engine
    engine.prefix_delta = ([_hash(1), _hash(2)], [])
    _hello(server, endpoint, b"a")
    server.heartbeat()
    [(_, first)] = endpoint.take()
    assert (first.stats.prefix_cache_seq, first.stats.prefix_cache_reset) == (1, True)
    assert sorted(_split(first.stats.prefix_cache_added)) == [_key(1), _key(2)]
    engine.prefix_delta = ([_hash(3)], [_hash(1)])
    server.send_outputs([], notify_all=True)
    [(_, second)] = endpoint.take()
    assert (second.stats.prefix_cache_seq, second.stats.prefix_cache_reset) == (2, False)
    assert (second.stats.prefix_cache_added, second.stats.prefix_cache_removed) == (_key(3), _key(1))
    # A second front end connects: a snapshot of what the cache holds now; the first gets only the change.
    _hello(server, endpoint, b"b")
    engine.prefix_delta = ([_hash(4)], [])
    server.send_outputs([], notify_all=True)
    sent = {peer: message.stats for peer, message in endpoint.take()}
    assert (sent[b"a"].prefix_cache_reset, sent[b"a"].prefix_cache_added) == (False, _key(4))
    assert sent[b"b"].prefix_cache_reset and sorted(_split(sent[b"b"].prefix_cache_added)) == [
        _key(2), _key(3), _key(4)
    ]  # fmt: skip
    # Nothing changed: an empty delta, still numbered (so a lost message shows as a gap).
    endpoint.inbox.append((b"a", _request("r1")))
    server.receive(timeout_ms=0)
    server.send_outputs([EngineCoreOutput("r1", [5])])  # a step that did not run: only a's output goes out
    [(peer, third)] = endpoint.take()
    assert peer == b"a" and third.stats.prefix_cache_seq == 4
    assert (third.stats.prefix_cache_added, third.stats.prefix_cache_removed) == (b"", b"")


def test_a_repeated_hello_asks_for_a_snapshot_again() -> None:
    server, endpoint = _server()
    server.engine.prefix_delta = ([_hash(1)], [])
    _hello(server, endpoint, b"a")
    server.heartbeat()
    server.send_outputs([], notify_all=True)
    endpoint.take()
    _hello(server, endpoint, b"a")
    server.send_outputs([], notify_all=True)
    [(_, message)] = endpoint.take()
    assert message.stats.prefix_cache_reset and message.stats.prefix_cache_added == _key(1)
    assert message.stats.prefix_cache_seq == 3


def _split(data: bytes) -> list[bytes]:
    return [data[i : i + 8] for i in range(0, len(data), 8)]


def test_the_stats_are_read_once_per_round_and_the_prefix_fields_stay_per_front_end() -> None:
    server, endpoint = _server()
    engine = server.engine
    engine.prefix_delta = ([_hash(1)], [])
    for peer in (b"a", b"b"):
        _hello(server, endpoint, peer)
    server.heartbeat()
    endpoint.take()
    _hello(server, endpoint, b"c")  # new: its next message carries the whole summary
    endpoint.inbox.append((b"a", _request("r1")))
    server.receive(timeout_ms=0)
    engine.prefix_delta = ([_hash(2)], [])
    calls = engine.num_stats_calls
    # A step that ran: a gets its output, b and c the stats alone; one read of the engine's stats for all three.
    server.send_outputs([EngineCoreOutput("r1", [5])], notify_all=True)
    sent = {peer: message for peer, message in endpoint.take()}
    assert engine.num_stats_calls == calls + 1
    assert [o.request_id for o in sent[b"a"].outputs] == ["r1"] and sent[b"b"].outputs == sent[b"c"].outputs == []
    assert {message.stats.num_running for message in sent.values()} == {calls + 1}
    assert sent[b"a"].stats.prefix_cache_added == sent[b"b"].stats.prefix_cache_added == _key(2)
    assert sent[b"c"].stats.prefix_cache_reset and sorted(_split(sent[b"c"].stats.prefix_cache_added)) == [
        _key(1), _key(2)
    ]  # fmt: skip
    # A heartbeat round: one read again.
    server.last_sent = 0.0
    server.heartbeat()
    assert len(endpoint.take()) == 3 and engine.num_stats_calls == calls + 2
    # A round with nobody to send to reads nothing.
    server.send_outputs([])
    assert endpoint.take() == [] and engine.num_stats_calls == calls + 2


def test_a_local_engine_runs_the_engine_process_entry_point() -> None:
    """``LocalEngineProcess`` names the engine's entry point in a string: it must still be there, and take
    the arguments the string passes."""
    tree = ast.parse(_BOOTSTRAP)
    imports = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               for alias in node.names]  # fmt: skip
    assert imports == [("tokenmill.engine_process", "run_engine_process")]
    entry_point = importlib.import_module("tokenmill.engine_process").run_engine_process
    inspect.signature(entry_point).bind({}, "ipc:///tmp/engine.sock", watch_parent=True)


def test_the_grammar_backend_waits_for_the_engine_to_be_idle_a_while() -> None:
    """The engine builds its grammar backend (about half a second with the GIL held) only after
    IDLE_BEFORE_PREPARE_S without an unfinished request, counted from its start or its last busy step, so the
    requests that follow a start do not wait for it."""
    now = [100.0]
    idle = _IdleWatch(clock=lambda: now[0])
    assert not idle.long_enough(busy=False)  # just started
    now[0] += IDLE_BEFORE_PREPARE_S - 0.1
    assert not idle.long_enough(busy=True)  # the first request came in time
    now[0] += 10.0
    assert not idle.long_enough(busy=True)  # busy for a long time
    assert not idle.long_enough(busy=False)  # idle from now on
    now[0] += IDLE_BEFORE_PREPARE_S - 0.1
    assert not idle.long_enough(busy=False)
    now[0] += 0.1
    assert idle.long_enough(busy=False)
