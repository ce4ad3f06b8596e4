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


def test_tenants_use_only_their_adapters_and_metrics_count_them(
    tokenmill_server: Callable[..., Any], lora_model_dir: Path, adapters: list[Path], tmp_path: Path
) -> None:
    keys = tmp_path / "keys.jsonl"
    keys.write_text(
        '{"key": "sk-a-0001", "tenant": "a", "lora_adapters": ["a0"]}\n'
        '{"key": "sk-b-0001", "tenant": "b", "default_lora_adapter": "b1"}\n'
    )
    server = tokenmill_server(
        "--enable-lora", "--max-loras", "2", "--lora-modules", f"a0={adapters[0]}",
        "--lora-modules", f"b1={adapters[1]}", "--api-keys", str(keys), model=lora_model_dir,
        api_key="sk-default-0001",
    )  # fmt: skip

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)

    a, b = client("sk-a-0001"), client("sk-b-0001")
    prompt = "the quick brown fox"
    assert {m.id for m in a.models.list().data} == {server.model, "a0"}
    assert {m.id for m in b.models.list().data} == {server.model, "b1"}
    assert {m.id for m in server.client.models.list().data} == {server.model}  # both adapters are claimed
    own = _complete(a, "a0", prompt)
    base = _complete(a, server.model, prompt)
    # b's requests naming the base model run with its default adapter, and say so.
    response = b.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0)
    assert response.model == "b1" and response.choices[0].text == _complete(b, "b1", prompt)
    assert len({own, base, response.choices[0].text}) == 3
    for other, model in ((a, "b1"), (b, "a0")):  # another tenant's adapter: 404, never the base model instead
        with pytest.raises(openai.NotFoundError) as raised:
            _complete(other, model, prompt)
        assert raised.value.code == "model_not_found"
        with pytest.raises(openai.NotFoundError):
            other.models.retrieve(model)
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer sk-a-0001"}).text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tokenmill:lora_")}  # fmt: skip
    model = f'model_name="{server.model}"'
    assert samples[f'tokenmill:lora_requests_total{{lora_name="a0",{model}}}'] == 1
    assert samples[f'tokenmill:lora_requests_total{{lora_name="b1",{model}}}'] == 2  # no 404 reached an engine
    assert samples[f'tokenmill:lora_generation_tokens_total{{lora_name="b1",{model}}}'] > 0
    info = [name for name in samples if name.startswith("tokenmill:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0], info


def test_adapters_on_data_parallel_engines(
    tokenmill_server: Callable[..., Any], lora_model_dir: Path, adapters: list[Path]
) -> None:
    server = tokenmill_server(
        "--enable-lora", "--max-loras", "2", "--lora-modules", f"a0={adapters[0]}", "--lora-modules",
        f"a1={adapters[1]}", "--data-parallel-size", "2", model=lora_model_dir,
    )  # fmt: skip
    prompt = "the quick brown fox"
    texts = {model: {_complete(server.client, model, prompt) for _ in range(4)} for model in (server.model, "a0", "a1")}
    # Whichever engine served each request, an adapter gives its own text, the same every time.
    assert all(len(found) == 1 for found in texts.values()), texts
    assert len({found.pop() for found in texts.values()}) == 3
    engines = {
        line.split('engine="')[1].split('"')[0]
        for line in httpx.get(f"{server.url}/metrics").text.splitlines()
        if line.startswith("tokenmill:lora_requests_info{")
    }
    assert engines == {"0", "1"}


def test_a_mixture_of_experts_serves_adapters_on_its_experts(
    tokenmill_server: Callable[..., Any], tmp_path: Path
) -> None:
    """A MoE model served with adapters on attention and its routed experts (PEFT's fused experts format), one
    named at start and one loaded at run time (the front end leaves a MoE model's check to the engine): each gives
    its own text, the one the offline engine gives."""
    from tests.lora.conftest import save_peft_adapter
    from tokenmill import LLM, LoRARequest, SamplingParams
    from tokenmill.testing.factories import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "moe", "qwen3-moe-tiny")
    started = save_peft_adapter(tmp_path / "started", base="qwen3-moe-tiny")
    loaded = save_peft_adapter(tmp_path / "loaded", base="qwen3-moe-tiny", seed=7)
    server = tokenmill_server("--enable-lora", "--max-lora-rank", "16", "--lora-modules", f"s={started}",
                              "--allow-runtime-lora-updating", model=model_dir)  # fmt: skip
    client = server.client
    answer = httpx.Client(base_url=server.url, timeout=30).post(
        "/v1/load_lora_adapter", json={"lora_name": "l", "lora_path": str(loaded)}
    )
    assert answer.status_code == 200, answer.text
    prompt = "the quick brown fox jumps"
    texts = {name: _complete(client, name, prompt) for name in (server.model, "s", "l")}
    assert len(set(texts.values())) == 3
    llm = LLM(model=str(model_dir), enable_lora=True, max_lora_rank=16, kv_cache_memory="64MiB")
    params = SamplingParams(max_tokens=8, temperature=0)
    for name, path, lora_id in (("s", started, 1), ("l", loaded, 2)):
        output = llm.generate([prompt], params, lora_request=LoRARequest(name, lora_id, str(path)), use_tqdm=False)
        assert output[0].outputs[0].text == texts[name], name
