"""Tenants through a real `tokenmill serve` and the official `openai` client: unknown keys, per-key 429s with
Retry-After, prefix caches isolated per tenant and per `cache_salt`, usage in /metrics by tenant, keys kept out
of metrics and logs."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import Server, start_tiny_server

_KEYS = [
    {"key": "sk-tenant-a-0001", "tenant": "a"},
    {"key": "sk-tenant-a-0002", "tenant": "a"},
    {"key": "sk-tenant-b-0001", "tenant": "b"},
    {"key": "sk-usage-0001", "tenant": "usage"},
    {"key": "sk-rpm-0001", "tenant": "rpm", "requests_per_minute": 2},
    {"key": "sk-tpm-0001", "tenant": "tpm", "tokens_per_minute": 30},
    {"key": "sk-conc-0001", "tenant": "conc", "max_concurrent_requests": 1},
]
_SINGLE_KEY = "sk-single-0001"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, smollm2_gguf: Path) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("tenants")
    keys = directory / "keys.jsonl"
    keys.write_text("".join(json.dumps(entry) + "\n" for entry in _KEYS))
    server = start_tiny_server(directory, tiny_model_dir, smollm2_gguf, "--api-keys", str(keys), "--api-key",
                               _SINGLE_KEY)  # fmt: skip
    yield server
    server.stop()


def _client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def _complete(server: Server, key: str, prompt: str = "Hello there", **options: Any) -> Any:
    return _client(server, key).completions.create(model=server.model, prompt=prompt, temperature=0, **options)


def _metric(server: Server, name: str) -> float:
    return server.metrics().get(name, 0.0)


def test_an_unknown_or_missing_key_gets_401(server: Server) -> None:
    before = _metric(server, 'tokenmill:request_rejected_total{reason="invalid_api_key"}')
    for key in ("sk-nobody", "sk-tenant-a-000", "sk-tenant-a-00011"):
        with pytest.raises(openai.AuthenticationError) as raised:
            _complete(server, key)
        assert raised.value.status_code == 401
        assert raised.value.code == "invalid_api_key"
    response = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "x"})
    assert response.status_code == 401 and response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401  # every route but /health and /metrics
    after = _metric(server, 'tokenmill:request_rejected_total{reason="invalid_api_key"}')
    assert after - before == 5


def test_every_key_works_including_the_single_one(server: Server) -> None:
    for key in [entry["key"] for entry in _KEYS[:4]] + [_SINGLE_KEY]:
        assert _complete(server, key, max_tokens=2).usage.completion_tokens == 2
    assert _metric(server, 'tokenmill:tenant_requests_total{tenant="default"}') >= 1


def _rate_limited(call: Any) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as raised:
        call()
    error = raised.value
    assert error.status_code == 429
    assert error.body is not None and error.body["type"] == "rate_limit_error"  # type: ignore[index]
    assert error.code == "rate_limit_exceeded"
    return error


def test_requests_per_minute(server: Server) -> None:
    started = time.monotonic()
    for _ in range(2):  # the bucket holds a minute's requests
        _complete(server, "sk-rpm-0001", max_tokens=1)
    error = _rate_limited(lambda: _complete(server, "sk-rpm-0001", max_tokens=1))
    retry_after = int(error.response.headers["retry-after"])
    elapsed = time.monotonic() - started
    assert 30 - elapsed - 1 <= retry_after <= 30  # one request comes back every 30 s
    assert "requests per minute" in error.message
    assert _metric(server, 'tokenmill:tenant_rejected_total{reason="requests_per_minute",tenant="rpm"}') == 1
    # Other keys are not affected.
    _complete(server, "sk-usage-0001", max_tokens=1)


def test_tokens_per_minute(server: Server) -> None:
    completion = _complete(server, "sk-tpm-0001", max_tokens=40, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 40
    overdrawn = completion.usage.prompt_tokens + 40 - 30  # a 30-token bucket, refilled at 0.5 per second
    error = _rate_limited(lambda: _complete(server, "sk-tpm-0001", max_tokens=1))
    retry_after = int(error.response.headers["retry-after"])
    assert 2 * overdrawn - 10 <= retry_after <= 2 * overdrawn + 1
    assert "tokens per minute" in error.message
    assert _metric(server, 'tokenmill:tenant_rejected_total{reason="tokens_per_minute",tenant="tpm"}') == 1


def test_max_concurrent_requests_and_the_slot_freed_when_a_stream_is_dropped(server: Server) -> None:
    client = _client(server, "sk-conc-0001")
    stream = client.completions.create(model=server.model, prompt="Once", max_tokens=900, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(stream))  # streaming: its slot is held until the stream ends
    error = _rate_limited(lambda: _complete(server, "sk-conc-0001", max_tokens=1))
    assert error.response.headers["retry-after"] == "1"
    assert "max concurrent requests" in error.message
    stream.close()  # the client goes away: the request is aborted and its slot freed
    deadline = time.monotonic() + 10
    while True:
        try:
            assert _complete(server, "sk-conc-0001", max_tokens=1).usage.completion_tokens == 1
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the slot was never freed"
            time.sleep(0.1)
    reason = 'tokenmill:tenant_rejected_total{reason="max_concurrent_requests",tenant="conc"}'
    assert _metric(server, reason) >= 1


def _hits(server: Server) -> float:
    return _metric(server, "tokenmill:prefix_cache_hits_total")


def _hit_delta(server: Server, key: str, prompt: str, **options: Any) -> float:
    before = _hits(server)
    _complete(server, key, prompt, max_tokens=1, **options)
    return _hits(server) - before


def _long_prompt(seed: int) -> str:
    """About 200 tokens no other test sends: several full KV blocks."""
    words = ["river", "stone", "cloud", "lantern", "meadow", "copper", "whistle", "orchard", "harbor", "signal"]
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(200))


def test_a_tenant_never_hits_another_tenants_prefix(server: Server) -> None:
    prompt = _long_prompt(1)
    assert _hit_delta(server, "sk-tenant-a-0001", prompt) == 0  # first time anywhere
    assert _hit_delta(server, "sk-tenant-b-0001", prompt) == 0  # tenant b: not a's blocks
    assert _hit_delta(server, _SINGLE_KEY, prompt) == 0  # nor the default tenant
    # The same tenant through its other key does hit (so the metric would show a leak).
    assert _hit_delta(server, "sk-tenant-a-0002", prompt) > 100
    assert _hit_delta(server, "sk-tenant-b-0001", prompt) > 100  # and b hits its own


def test_cache_salt_separates_caches_within_a_tenant(server: Server) -> None:
    prompt = _long_prompt(2)
    assert _hit_delta(server, "sk-tenant-a-0001", prompt, extra_body={"cache_salt": "project-1"}) == 0
    assert _hit_delta(server, "sk-tenant-a-0002", prompt, extra_body={"cache_salt": "project-2"}) == 0
    assert _hit_delta(server, "sk-tenant-a-0002", prompt) == 0  # no salt is a salt of its own
    assert _hit_delta(server, "sk-tenant-a-0002", prompt, extra_body={"cache_salt": "project-1"}) > 100
    assert _hit_delta(server, "sk-tenant-b-0001", prompt, extra_body={"cache_salt": "project-1"}) == 0
    # And on the chat endpoint.
    chat = _client(server, "sk-tenant-a-0001").chat.completions
    before = _hits(server)
    for _ in range(2):
        chat.create(model=server.model, messages=[{"role": "user", "content": prompt}], max_tokens=1,
                    extra_body={"cache_salt": "chat-salt"})  # fmt: skip
    assert _hits(server) - before > 100


@pytest.mark.parametrize("salt", [5, "", ["x"], "x" * 1025])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_cache_salt_is_a_400(server: Server, salt: Any, path: str) -> None:
    body: dict[str, Any] = {"model": server.model, "cache_salt": salt, "max_tokens": 1}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    response = httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": "Bearer sk-usage-0001"})
    assert response.status_code == 400
    assert "cache_salt" in response.json()["error"]["message"]


def test_usage_metrics_by_tenant(server: Server) -> None:
    name = 'tokenmill:tenant_{}_total{{tenant="usage"}}'
    before = {kind: _metric(server, name.format(kind)) for kind in ("requests", "prompt_tokens", "generation_tokens")}
    prompt_tokens = completion_tokens = 0
    for max_tokens in (3, 5):
        usage = _complete(server, "sk-usage-0001", "Count with me", max_tokens=max_tokens,
                          extra_body={"ignore_eos": True}).usage  # fmt: skip
        prompt_tokens += usage.prompt_tokens
        completion_tokens += usage.completion_tokens
    stream = _client(server, "sk-usage-0001").chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage is not None
    prompt_tokens += chunks[-1].usage.prompt_tokens
    completion_tokens += chunks[-1].usage.completion_tokens
    after = {kind: _metric(server, name.format(kind)) for kind in before}
    assert after["requests"] - before["requests"] == 3
    assert after["prompt_tokens"] - before["prompt_tokens"] == prompt_tokens
    assert after["generation_tokens"] - before["generation_tokens"] == completion_tokens == 12


def test_keys_never_appear_in_metrics_or_logs(server: Server) -> None:
    _complete(server, "sk-tenant-a-0001", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        _complete(server, "sk-guessed-key", max_tokens=1)
    text = httpx.get(f"{server.url}/metrics").text
    assert 'tenant="a"' in text
    log = server.log.read_text()
    for key in [entry["key"] for entry in _KEYS] + [_SINGLE_KEY, "sk-guessed-key"]:
        assert key not in text and key not in log
