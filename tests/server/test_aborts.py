"""Clients that drop their requests at random points: no errors, every KV block back on the free list,
and the same greedy output afterwards (issue 18: "Keep it that way").

The requests are the soak's (``tokenmill_plugins.commands.bench.soak``), every one of them planned as an abort: a stream
dropped after a random number of content chunks (0: as soon as the headers arrive), a plain request after
a random part of the mean latency, so some are dropped while queued, some in prefill, some mid-decode,
and some finish first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenmill_plugins.commands.bench.soak import SoakOptions, SoakWorkload, Tally, parse_metrics, send_soak_request

from tests.server.conftest import Server, start_tiny_server

pytestmark = pytest.mark.multiproc

_GREEDY = {"prompt": [1000 + 7 * i for i in range(40)], "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=[(), ("--async-scheduling",)], ids=["sync", "async"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, smollm2_gguf: Path
) -> Iterator[Server]:
    """A tiny model of its own, so that no other test's requests hold blocks while these count them; with and
    without async scheduling (aborts then land on requests whose step is still in flight)."""
    server = start_tiny_server(
        tmp_path_factory.mktemp("aborts"), tiny_model_dir, smollm2_gguf, "--max-num-seqs", "64", *request.param
    )
    yield server
    server.stop()


def _greedy(server: Server) -> Any:
    response = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, **_GREEDY}, timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def _wait_for_idle(server: Server, timeout_s: float = 30.0) -> dict[str, float | None]:
    """The engines' gauges once nothing runs, waits or holds a KV block (heartbeats come every 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = parse_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)
        gauges = {
            "kv_cache_usage": samples.get("tokenmill:kv_cache_usage_perc"),
            "running": samples.get("tokenmill:num_requests_running"),
            "waiting": samples.get("tokenmill:num_requests_waiting"),
        }
        if all(value == 0 for value in gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.25)


async def _abort_all(server: Server, num_requests: int, concurrency: int, tmp_path: Path) -> Tally:
    """``num_requests`` soak requests (short ones: the tiny model is fast), each planned as an abort."""
    options = SoakOptions(
        base_url=server.url, output_dir=tmp_path, duration_s=1.0, warmup_s=0, input_len=(4, 64), output_len=(4, 48),
        abort_fraction=1.0, seed=18,
    )  # fmt: skip
    workload = SoakWorkload(options)
    tally = Tally(mean_plain_latency_s=0.05)
    indices = iter(range(num_requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def loop() -> None:
            for index in indices:
                request = workload.request(index)
                assert request.is_abort
                abort_after_s = None if request.abort_at is None else request.abort_at * tally.mean_plain_latency_s
                outcome = await send_soak_request(
                    client, server.url, server.model, request, abort_after_s=abort_after_s
                )
                tally.add(request, outcome)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return tally


#: The large run's aborts: 3,000 under the synchronous loop, 1,500 under async scheduling (the same paths with a
#: step in flight). Issue 18 asked for 10,000: CI ran them under the synchronous loop (162-173 s on 2 vCPUs) and
#: 2,000 under async, and its whole run passed 30 minutes.
LARGE_RUN = {"sync": 3_000, "async": 1_500}


@pytest.mark.parametrize("size", ["400", pytest.param("large", marks=pytest.mark.slow)])
def test_random_aborts_free_every_block(
    server: Server, tmp_path: Path, size: str, request: pytest.FixtureRequest
) -> None:
    loop = "async" if request.node.callspec.params["server"] else "sync"
    num_requests = 400 if size == "400" else LARGE_RUN[loop]
    before = _greedy(server)
    assert _wait_for_idle(server)["kv_cache_usage"] == 0
    tally = asyncio.run(_abort_all(server, num_requests, concurrency=32, tmp_path=tmp_path))
    assert tally.num_errors == 0, (dict(tally.errors), tally.error_examples)
    assert tally.rejected == 0
    assert tally.aborted + tally.completed == num_requests
    # Most are really dropped before their answer ends (the rest finished first, which is fine).
    assert tally.aborted >= 0.6 * num_requests, (tally.aborted, tally.completed)
    assert tally.shapes["stream"] and tally.shapes["non-stream"] and tally.shapes["n>1"]
    gauges = _wait_for_idle(server)
    assert gauges == {"kv_cache_usage": 0, "running": 0, "waiting": 0}, gauges
    assert _greedy(server) == before
