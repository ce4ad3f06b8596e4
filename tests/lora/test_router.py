"""The ``lora_aware`` router behind a real `tokenmill serve --data-parallel-size 2 --enable-lora`, driven by the
official openai client: while the loads are balanced, every request for an adapter goes to the engine that holds
it, and a second adapter goes to the engine with a free slot, as the engines' own per-engine metrics show."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

LONG_MAX_TOKENS = 900  # the request that holds adapter a on its engine while the others arrive
#: The burst, in the order sent: (model, max_tokens). Each model gets its own max_tokens, so an engine's
#: finished requests and generated tokens together say which requests it served.
BURST = [("b", 11), ("a", 7), ("b", 11), ("base", 13), ("b", 11), ("a", 7), ("b", 11), ("a", 7), ("b", 11)]


def _samples(server: Any, name: str) -> list[tuple[dict[str, str], float]]:
    """The labels and value of each sample of ``name`` on the server's /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    families = text_string_to_metric_families(text)
    return [(sample.labels, sample.value) for family in families for sample in family.samples if sample.name == name]


def _served(server: Any) -> tuple[dict[str, float], dict[str, float]]:
    """Per engine: requests finished at ``max_tokens``, and tokens generated."""
    finished = _samples(server, "tokenmill:request_success_total")
    tokens = _samples(server, "tokenmill:generation_tokens_total")
    return ({labels["engine"]: value for labels, value in finished if labels["finished_reason"] == "length"},
            {labels["engine"]: value for labels, value in tokens})  # fmt: skip


def _engines_running(server: Any, lora_name: str) -> list[str]:
    """The engines whose running requests name ``lora_name`` (``tokenmill:lora_requests_info``)."""
    info = _samples(server, "tokenmill:lora_requests_info")
    return [labels["engine"] for labels, _ in info if lora_name in labels["running_lora_adapters"].split(",")]


def test_lora_aware_keeps_each_adapter_on_one_engine(
    tokenmill_server: Callable[..., Any], lora_model_dir: Path, adapters: list[Path]
) -> None:
    server = tokenmill_server(
        "--enable-lora", "--max-loras", "1", "--lora-modules", f"a={adapters[0]}", "--lora-modules",
        f"b={adapters[1]}", "--data-parallel-size", "2", "--router", "lora_aware", "--num-kv-blocks", "1024",
        model=lora_model_dir,
    )  # fmt: skip
    start_finished, start_tokens = _served(server)
    holders: list[str] = []

    async def drive() -> None:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)

        def complete(model: str, max_tokens: int) -> Any:
            model = server.model if model == "base" else model
            return client.completions.create(model=model, prompt="the quick brown fox", max_tokens=max_tokens,
                                             temperature=0, extra_body={"ignore_eos": True})  # fmt: skip

        async with client:
            long_a = asyncio.create_task(complete("a", LONG_MAX_TOKENS))
            deadline = time.monotonic() + 60
            while not (running := _engines_running(server, "a")):
                assert time.monotonic() < deadline and not long_a.done(), "adapter a never showed as running"
                await asyncio.sleep(0.02)
            holders.extend(running)
            responses = await asyncio.gather(*(complete(model, max_tokens) for model, max_tokens in BURST))
            assert not long_a.done(), "the long request ended before the burst did; the test needs it running"
            assert [response.usage.completion_tokens for response in responses] == [n for _, n in BURST]
            assert (await long_a).usage.completion_tokens == LONG_MAX_TOKENS

    asyncio.run(drive())
    (engine_a,) = holders
    engine_b = "1" if engine_a == "0" else "0"
    # a's requests (the long one and three more) on engine_a; b's five (a new adapter: engine_a's only slot was
    # a's, so to the engine with a free slot) and the base-model one (the least loaded) on engine_b.
    expected_finished = {engine_a: 1 + 3, engine_b: 5 + 1}
    expected_tokens = {engine_a: LONG_MAX_TOKENS + 3 * 7, engine_b: 5 * 11 + 13}
    deadline = time.monotonic() + 10
    while True:  # the engines' counters arrive with their next stats
        finished, tokens = _served(server)
        finished = {engine: finished[engine] - start_finished.get(engine, 0) for engine in finished}
        tokens = {engine: tokens[engine] - start_tokens.get(engine, 0) for engine in tokens}
        if (finished, tokens) == (expected_finished, expected_tokens) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (finished, tokens) == (expected_finished, expected_tokens)
    samples = server.metrics()
    assert all(value == 0 for key, value in samples.items() if key.startswith("tokenmill:router_fallbacks_total"))
