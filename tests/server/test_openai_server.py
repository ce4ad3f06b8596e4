"""`tokenmill serve` driven by the official openai client, as a user would."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, Server, start_tiny_server
from tokenmill import LLM, SamplingParams
from tokenmill.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

PROMPT = "The three primary colours are"
_ABORTED = 'tokenmill:request_success_total{finished_reason="abort"}'


@pytest.fixture(scope="module")
def client(default_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_gguf)


def _good_request_succeeds(client: openai.OpenAI, model: str) -> None:
    response = client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length")


def test_models(client: openai.OpenAI, default_server: Server) -> None:
    assert [m.id for m in client.models.list().data] == [default_server.model]


def test_completion_streaming_equals_non_streaming(client, default_server, tokenizer) -> None:  # type: ignore[no-untyped-def]
    full = client.completions.create(model=default_server.model, prompt=PROMPT, max_tokens=24, temperature=0)
    choice = full.choices[0]
    assert full.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    counted = client.completions.create(model=default_server.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                        logprobs=0)  # fmt: skip
    # One logprobs entry per generated token: usage counts exactly the tokens generated.
    assert counted.usage.completion_tokens == len(counted.choices[0].logprobs.tokens) >= 1
    assert counted.choices[0].text == choice.text
    chunks = list(client.completions.create(
        model=default_server.model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_streaming_shape(client: openai.OpenAI, default_server: Server) -> None:
    messages = [{"role": "user", "content": "Name one planet."}]
    full = client.chat.completions.create(model=default_server.model, messages=messages, max_tokens=16, temperature=0)
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        model=default_server.model, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    with_reason = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(with_reason) == 1 and with_reason[0].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_n_stop_logprobs_and_seed(client: openai.OpenAI, default_server: Server) -> None:
    model = default_server.model
    two = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, n=2, seed=3)
    assert sorted(c.index for c in two.choices) == [0, 1]
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, n=2, seed=3)
    assert [c.text for c in again.choices] == [c.text for c in two.choices]  # seeded: reproducible

    greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = greedy[6:9]
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert stopped.choices[0].text == greedy[: greedy.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    with_logprobs = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    logprobs = with_logprobs.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(len(top) == 2 and max(top.values()) <= 0 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    entries = chat.choices[0].logprobs.content
    assert entries and all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)


def test_logit_bias_steers_and_a_stop_string_ends_one_of_n(client, default_server, tokenizer) -> None:  # type: ignore[no-untyped-def]
    model = default_server.model
    greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    forced = tokenizer.encode(" banana")[0]
    biased = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(forced): 100}, logprobs=0
    )
    assert biased.choices[0].text != greedy.choices[0].text
    assert set(biased.choices[0].logprobs.tokens) == {tokenizer.decode([forced])}  # every token forced
    banned = tokenizer.encode(greedy.choices[0].text)[0]
    avoided = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(banned): -100}, logprobs=0
    )
    assert tokenizer.decode([banned]) not in avoided.choices[0].logprobs.tokens
    with pytest.raises(openai.BadRequestError, match=r"logit_bias has token id 999999, outside the vocabulary"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, logit_bias={"999999": 1})
    # n=2 with a stop string that only the biased completion... every completion still finishes.
    two = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=5,
                                    stop=[greedy.choices[0].text[3:6]])  # fmt: skip
    assert sorted(c.index for c in two.choices) == [0, 1] and all(c.finish_reason for c in two.choices)
    _good_request_succeeds(client, model)


@pytest.mark.parametrize(
    ("kwargs", "status"),
    [
        ({"temperature": -1}, 400),
        ({"max_tokens": 9000}, 400),  # prompt + max_tokens beyond the 8192-token context
        ({"model": "no-such-model"}, 404),
        ({"extra_body": {"not_a_parameter": 1}}, 400),
    ],
)
def test_errors_are_openai_shaped_and_the_server_keeps_serving(client, default_server, kwargs, status) -> None:  # type: ignore[no-untyped-def]
    arguments = {"model": default_server.model, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as excinfo:
        client.completions.create(**arguments)
    assert excinfo.value.status_code == status
    body = excinfo.value.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"} and body["error"]["message"]
    _good_request_succeeds(client, default_server.model)


def test_context_length_error_wording(client: openai.OpenAI, default_server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model=default_server.model, prompt=PROMPT, max_tokens=9000)
    assert "maximum context length is 8192 tokens" in excinfo.value.message


def test_wrong_or_missing_api_key_is_401(default_server: Server) -> None:
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(f"{default_server.url}/v1/completions", headers=headers,
                              json={"model": default_server.model, "prompt": "x"})  # fmt: skip
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_malformed_body_is_400(default_server: Server) -> None:
    response = httpx.post(f"{default_server.url}/v1/chat/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_health_version_metrics(default_server: Server) -> None:
    assert httpx.get(f"{default_server.url}/health").json() == {"status": "ok"}
    headers = {"Authorization": f"Bearer {API_KEY}"}  # every route but /health and /metrics needs the key
    assert "version" in httpx.get(f"{default_server.url}/version", headers=headers).json()
    metrics = default_server.metrics()
    for name in ("tokenmill:time_to_first_token_seconds_count", "tokenmill:kv_cache_usage_perc",
                 "tokenmill:num_requests_running", "tokenmill:prefix_cache_queries_total"):  # fmt: skip
        assert any(key.startswith(name) for key in metrics), name


def test_greedy_outputs_equal_the_offline_engine(client, default_server, smollm2_gguf) -> None:  # type: ignore[no-untyped-def]
    prompts = [PROMPT, "def add(a, b):", "Paris is the capital of", "1, 2, 3,"]
    offline = LLM(str(smollm2_gguf), device="cpu", kv_cache_memory="128MiB")
    expected = [o.outputs[0].text for o in offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)]  # fmt: skip
    alone = [client.completions.create(model=default_server.model, prompt=p, max_tokens=20, temperature=0)
             .choices[0].text for p in prompts]  # fmt: skip
    assert alone == expected

    async def concurrently() -> list[str]:
        async_client = openai.AsyncOpenAI(
            base_url=f"{default_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60
        )
        responses = await asyncio.gather(*(
            async_client.completions.create(model=default_server.model, prompt=p, max_tokens=20, temperature=0)
            for p in prompts * 3
        ))  # fmt: skip
        return [r.choices[0].text for r in responses]

    assert asyncio.run(concurrently()) == expected * 3


def test_64_concurrent_streams_get_their_lengths_and_65_more_get_429_with_retry_after(tiny_server: Server) -> None:
    async def stream(client: openai.AsyncOpenAI, max_tokens: int) -> int:
        chunks = await client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=max_tokens, temperature=0.8, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        usage = None
        async for chunk in chunks:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def run(count: int) -> list[int | BaseException]:
        client = openai.AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        return await asyncio.gather(*(stream(client, 20 + i % 7) for i in range(count)), return_exceptions=True)

    results = asyncio.run(run(64))
    assert results == [20 + i % 7 for i in range(64)]
    crowded = asyncio.run(run(80))
    rejected = [r for r in crowded if isinstance(r, openai.RateLimitError)]
    assert len(rejected) >= 16 and all(isinstance(r, int) or r in rejected for r in crowded)
    assert {r.response.headers["retry-after"] for r in rejected} == {"1"}
    assert tiny_server.metrics()["tokenmill:kv_cache_usage_perc"] == 0.0


def test_disconnect_after_5_tokens_aborts_and_frees_blocks(tiny_server: Server) -> None:
    before = tiny_server.metrics()[_ABORTED]
    body = {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 900, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    received = 0
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                received += 1
                if received == 5:
                    break  # closing the stream drops the connection
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = tiny_server.metrics()
        aborted = metrics[_ABORTED]
        if aborted == before + 1 and metrics["tokenmill:kv_cache_usage_perc"] == 0.0:
            break
        time.sleep(0.1)
    assert aborted == before + 1
    assert metrics["tokenmill:kv_cache_usage_perc"] == 0.0
    assert metrics["tokenmill:num_requests_running"] == 0.0


def test_bench_serve_writes_its_report(tiny_server: Server, tmp_path: Path) -> None:
    import subprocess
    import sys

    report = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--url", tiny_server.url, "--concurrency", "4",
         "--num-requests", "12", "--input-len", "32", "--output-len", "16", "--output-json", str(report)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads(report.read_text())["results"]
    assert (results["num_completed"], results["num_failed"]) == (12, 0)
    assert results["total_input_tokens"] == 12 * 32  # the server's usage counts agree with the request
    assert results["total_output_tokens"] == 12 * 16
    assert 0 < results["ttft_ms"]["p50"] <= results["e2e_ms"]["p50"]


def test_killing_the_engine_fails_requests_fast_and_the_server_exits(
    tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path
) -> None:
    import os

    """With ``--max-engine-restarts 0`` a dead engine stops the server (tests/server/test_supervision.py: restarts)."""
    server = start_tiny_server(tmp_path, tiny_model_dir, smollm2_gguf, "--max-engine-restarts", "0")
    try:
        engine_pids = [int(p) for p in os.popen(f"pgrep -P {server.process.pid}").read().split()]
        assert engine_pids
        body = {"model": "tiny", "prompt": "Go", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
        with httpx.Client(timeout=30) as http:
            started = time.monotonic()
            pending = http.build_request("POST", f"{server.url}/v1/completions", json=body)
            import threading

            result: dict[str, httpx.Response] = {}
            thread = threading.Thread(target=lambda: result.setdefault("r", http.send(pending)))
            thread.start()
            time.sleep(0.3)  # mid-generation: 1000 tokens take the tiny model a few seconds
            for pid in engine_pids:
                os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            thread.join(10)
            assert not thread.is_alive()
            assert time.monotonic() - killed < 5
            assert result["r"].status_code == 503
            assert result["r"].json()["error"]["type"] == "server_error"
            assert started < killed
        assert server.process.wait(15) == 1  # documented: the server exits non-zero, saying why
        last_line = server.log.read_text().strip().splitlines()[-1]
        assert "exiting with status 1: engine 0 died (engine process was killed by SIGKILL)" in last_line
    finally:
        server.stop()


def _completion(url: str, prompt: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_remote_engine_over_tcp(tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path) -> None:
    import subprocess
    import sys

    from tests.server.conftest import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    engine_log = (tmp_path / "engine.log").open("w")
    engine = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "engine", "--listen", address, str(tiny_model_dir),
         "--device", "cpu", "--num-kv-blocks", "512"],
        stdout=engine_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        server = start_tiny_server(tmp_path, tiny_model_dir, smollm2_gguf, "--engine", address)
        try:
            response = _completion(server.url, "Hello over TCP")
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
            assert server.process.poll() is None and engine.poll() is None
        finally:
            assert server.stop() == 0
        assert engine.poll() is None  # the engine outlives a front end that connected to it
    finally:
        engine.terminate()
        assert engine.wait(30) == 0


def test_data_parallel_engines_share_the_load(tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path) -> None:
    server = start_tiny_server(tmp_path, tiny_model_dir, smollm2_gguf, "--data-parallel-size", "2")
    try:
        for i in range(4):
            assert _completion(server.url, f"Request number {i}").status_code == 200
        text = httpx.get(f"{server.url}/metrics").text
        queries = [line for line in text.splitlines() if line.startswith("tokenmill:prefix_cache_queries_total{")]
        by_engine = {line.split('engine="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in queries}
        assert set(by_engine) == {"0", "1"} and all(v > 0 for v in by_engine.values())  # round-robin used both
    finally:
        assert server.stop() == 0


def test_sigterm_drains_running_requests(tmp_path: Path, tiny_model_dir: Path, smollm2_gguf: Path) -> None:
    import threading

    server = start_tiny_server(tmp_path, tiny_model_dir, smollm2_gguf)
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", _completion(server.url, "Drain me", 1000)))
    thread.start()
    time.sleep(0.3)
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    health = httpx.get(f"{server.url}/health", timeout=2)  # the port stays open while draining, refusing new work
    assert health.status_code == 503 and health.json()["status"] == "draining"
    refused = _completion(server.url, "Too late")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    thread.join(60)
    assert result["r"].status_code == 200
    assert result["r"].json()["usage"]["completion_tokens"] == 1000  # the running request finished
    assert server.process.wait(30) == 0


def test_chat_cli_talks_to_a_server(tiny_server: Server) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "chat", "--url", tiny_server.url, "--max-tokens", "5",
         "--temperature", "0"],
        input="Hello there\n/reset\nSecond question\n/exit\n", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    replies = [line for line in result.stdout.splitlines() if "model> " in line]
    assert len(replies) == 2 and all(line.split("model> ", 1)[1] for line in replies)
