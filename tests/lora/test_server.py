"""Adapters through ``tokenmill serve`` with the official openai client, as vLLM serves them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def _complete(client: openai.OpenAI, model: str, prompt: str) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text


def test_adapters_by_name_loaded_and_unloaded_at_run_time(
    tokenmill_server: Callable[..., Any], lora_model_dir: Path, adapters: list[Path]
) -> None:
    server = tokenmill_server(
        "--enable-lora", "--max-loras", "2", "--lora-modules", f"a0={adapters[0]}",
        "--lora-modules", f'{{"name": "a1", "path": "{adapters[1]}", "base_model_name": "tiny"}}',
        "--allow-runtime-lora-updating", "--block-size", "4", model=lora_model_dir,
    )  # fmt: skip
    client = server.client
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {server.model, "a0", "a1"}
    assert models["a0"].model_extra["parent"] == server.model
    prompt = "the quick brown fox jumps over the lazy dog and then"  # several blocks of 4 tokens
    base, first, second = (_complete(client, m, prompt) for m in (server.model, "a0", "a1"))
    assert len({base, first, second}) == 3
    response = client.completions.create(model="a0", prompt=prompt, max_tokens=8, temperature=0)
    assert response.model == "a0" and response.choices[0].text == first
    # Prefix cache: the same prompt again under each name hits only its own blocks (and gives its own text).
    assert [_complete(client, m, prompt) for m in ("a1", server.model, "a0")] == [second, base, first]
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a2", prompt)

    post = httpx.Client(base_url=server.url, timeout=30).post
    answer = post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters[2])})
    assert answer.status_code == 200, answer.text
    assert "a2" in {m.id for m in client.models.list().data}
    assert _complete(client, "a2", prompt) not in (base, first, second)
    assert post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters[2])}).status_code == 400
    assert post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a2", prompt)
    assert post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 404
    wrong = post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(lora_model_dir)})
    assert wrong.status_code == 400 and "adapter_config.json" in wrong.json()["error"]["message"]
