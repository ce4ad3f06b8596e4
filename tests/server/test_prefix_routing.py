"""Two real engine processes behind one `tokenmill serve --data-parallel-size 2 --router prefix_aware`: requests
that share a prefix land on the engine whose prefix cache holds it, which the engines' own per-engine metrics
(requests finished, prefix cache hits) show, while a request with another prefix goes to the other engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import Server, start_tiny_server

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

PREFIX_LEN = 96  # six blocks of 16
PREFIX_A = [1000 + t for t in range(PREFIX_LEN)]
PREFIX_B = [3000 + t for t in range(PREFIX_LEN)]


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, smollm2_gguf: Path) -> Iterator[Server]:
    server = start_tiny_server(
        tmp_path_factory.mktemp("prefix-routing"), tiny_model_dir, smollm2_gguf, "--data-parallel-size", "2",
        "--router", "prefix_aware",
    )  # fmt: skip
    yield server
    server.stop()


def _per_engine(server: Server, name: str, **labels: str) -> dict[str, float]:
    """``name``'s samples by engine, among those with ``labels``."""
    values: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if not line.startswith(name + "{"):
            continue
        sample, value = line.rsplit(" ", 1)
        pairs = dict(item.split("=", 1) for item in sample[len(name) + 1 : -1].split(","))
        if all(pairs.get(key) == f'"{wanted}"' for key, wanted in labels.items()):
            values[pairs["engine"].strip('"')] = float(value)
    return values


def _finished(server: Server) -> dict[str, float]:
    return _per_engine(server, "tokenmill:request_success_total", finished_reason="length")


def _complete(client: httpx.Client, server: Server, prompt: list[int], max_tokens: int = 2) -> None:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = client.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text


def _wait_for_summary(server: Server, engine: str, min_blocks: int) -> None:
    deadline = time.monotonic() + 10
    while _per_engine(server, "tokenmill:prefix_cache_summary_blocks").get(engine, 0) < min_blocks:
        assert time.monotonic() < deadline, "the engine's prefix cache summary never reached the front end"
        time.sleep(0.05)


def test_requests_sharing_a_prefix_land_on_the_engine_that_holds_it(two_engines: Server) -> None:
    server = two_engines
    start = _finished(server)
    engines: list[str] = []

    async def first_two() -> None:
        # A long request with prefix A takes an engine; B, sent while it runs, goes to the other (least loaded).
        async with httpx.AsyncClient(timeout=120) as client:
            url, body = f"{server.url}/v1/completions", {"model": server.model, "temperature": 0, "ignore_eos": True}
            long_a = asyncio.create_task(client.post(url, json={**body, "prompt": PREFIX_A + [7], "max_tokens": 900}))
            deadline = time.monotonic() + 30
            while not (running := _per_engine(server, "tokenmill:num_requests_running")) or max(running.values()) < 1:
                assert time.monotonic() < deadline and not long_a.done(), "the long request never showed as running"
                await asyncio.sleep(0.01)
            engines.append(max(running, key=lambda engine: running[engine]))
            first_b = await client.post(url, json={**body, "prompt": PREFIX_B + [7], "max_tokens": 2})
            assert first_b.status_code == 200 and not long_a.done()
            assert (await long_a).status_code == 200

    asyncio.run(first_two())
    (engine_a,) = engines
    engine_b = "1" if engine_a == "0" else "0"
    after_first = _finished(server)
    assert after_first[engine_a] - start[engine_a] == 1, (start, after_first)
    assert after_first[engine_b] - start[engine_b] == 1, (start, after_first)  # B went to the other engine
    _wait_for_summary(server, engine_a, PREFIX_LEN // 16)
    _wait_for_summary(server, engine_b, PREFIX_LEN // 16)
    hits_before = _per_engine(server, "tokenmill:prefix_cache_hits_total")
    with httpx.Client() as client:
        # Interleaved tenants, each a short distinct suffix after its prefix, in an order that neither
        # round-robin nor least-loaded (idle engines: the lowest index) would split by tenant.
        for number, tenant in enumerate("AABBABBA"):
            _complete(client, server, (PREFIX_A if tenant == "A" else PREFIX_B) + [10 + number, 20 + number])
    finished = _finished(server)
    hits = _per_engine(server, "tokenmill:prefix_cache_hits_total")
    assert finished[engine_a] - after_first[engine_a] == 4
    assert finished[engine_b] - after_first[engine_b] == 4
    # Every follower reused its whole prefix on its engine: 4 x 96 tokens each, none missed.
    assert hits[engine_a] - hits_before[engine_a] >= 4 * PREFIX_LEN
    assert hits[engine_b] - hits_before[engine_b] >= 4 * PREFIX_LEN
    samples = server.metrics()
    assert all(value == 0 for key, value in samples.items() if key.startswith("tokenmill:router_fallbacks_total"))
