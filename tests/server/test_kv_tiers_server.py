"""KV tiers through real servers and the official openai client: a prefix cache that survives a restart, and
disaggregated prefill (two engine processes joined by the ZeroMQ KV connector) with output identical to one."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.server.conftest import Server, start_tiny_server

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

LONG_PROMPT = "The committee reviewed the annual report on rivers, bridges and railways. " * 12


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _complete(server: Server, prompt: str = LONG_PROMPT) -> str:
    response = _client(server).completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0)
    return response.choices[0].text


def _tier_counter(server: Server, counter: str, tier: str) -> float:
    return server.metrics().get(f'tokenmill:kv_tier_{counter}_total{{tier="{tier}"}}', 0.0)


def _tier_hits(server: Server, tier: str) -> float:
    return _tier_counter(server, "hits", tier)


def test_a_restarted_server_loads_a_long_prompt_from_its_disk_tier(
    tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path
) -> None:
    tier = f"disk:64MiB:{tmp_path / 'kv'}"
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = start_tiny_server(tmp_path / "first", tiny_model_dir, smollm2_gguf, "--kv-tier", tier)
    try:
        expected = _complete(first)
        assert _tier_hits(first, "disk") == 0
    finally:
        assert first.stop() == 0  # SIGTERM: the engine flushes the tier's writes before it exits
    second = start_tiny_server(tmp_path / "second", tiny_model_dir, smollm2_gguf, "--kv-tier", tier)
    try:
        assert _complete(second) == expected
        assert _tier_hits(second, "disk") > 0  # loaded from disk, not recomputed
        assert _tier_counter(second, "loads", "disk") == 1 and _tier_counter(second, "load_seconds", "disk") > 0
    finally:
        second.stop()


def test_disaggregated_prefill_gives_the_output_of_one_engine(
    tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path, tiny_server: Server
) -> None:
    server = start_tiny_server(tmp_path, tiny_model_dir, smollm2_gguf, "--disaggregated-prefill")
    try:
        client = _client(server)
        for prompt in (LONG_PROMPT, "Short one.", LONG_PROMPT + " And more."):
            assert _complete(server, prompt) == _complete(tiny_server, prompt)
        messages = [{"role": "user", "content": LONG_PROMPT}]
        stream = client.chat.completions.create(
            model=server.model,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        )
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        reference = _client(tiny_server).chat.completions.create(
            model=tiny_server.model,
            messages=messages,
            max_tokens=12,
            temperature=0,  # type: ignore[arg-type]
        )
        assert streamed == reference.choices[0].message.content
        assert _tier_hits(server, "zmq-pull") > 0  # the decode engine loaded the shipped blocks
        assert _tier_counter(server, "bytes_written", "zmq-push") > 0
    finally:
        server.stop()
