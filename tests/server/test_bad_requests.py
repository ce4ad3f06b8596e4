"""Malformed requests through a real server: each gets its 4xx in OpenAI's error shape naming the field, and the
server keeps serving. The rows include every request that once produced a 500 or a dropped connection."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.conftest import API_KEY, Server

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

MODEL = "SmolLM2-135M-Instruct-Q4_1"  # the default_server fixture's name
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_PROMPT = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def completion(**fields: Any) -> bytes:
    return json.dumps({**OK_PROMPT, **fields}).encode()


def chat(**fields: Any) -> bytes:
    return json.dumps({**OK_CHAT, **fields}).encode()


def deep(levels: int) -> bytes:
    return (
        b'{"model": "%s", "prompt": "x", "vllm_xargs": {"a": ' % MODEL.encode() + b"[" * levels + b"]" * levels + b"}}"
    )


# (name, path, body, status, param or code the error names)
CASES: list[tuple[str, str, bytes, int, str | None]] = [
    ("not JSON", C, b"{not json", 400, None),
    ("not UTF-8", C, b'{"model": "\xff\xfe", "prompt": "x"}', 400, None),
    ("array body", C, b"[1, 2]", 400, None),
    ("empty body", C, b"", 400, None),
    ("nested 100k deep", C, deep(100_000), 400, None),
    ("free-form nested 40 deep", C, deep(40), 400, "vllm_xargs"),
    ("missing model", C, json.dumps({"prompt": "x"}).encode(), 400, "model"),
    ("unknown model", C, completion(model="gpt-5"), 404, "model"),
    ("unknown field", C, completion(temprature=1), 400, "temprature"),
    ("stream not a bool", C, completion(stream="yes"), 400, "stream"),
    ("temperature a string", C, completion(temperature="hot"), 400, "temperature"),
    ("temperature negative", C, completion(temperature=-1), 400, "temperature"),
    ("top_p zero", C, completion(top_p=0), 400, "top_p"),
    ("seed 2^70", C, completion(seed=2**70), 400, "seed"),
    ("priority -2^70", C, completion(priority=-(2**70)), 400, "priority"),
    ("top_k 2^40", C, completion(top_k=2**40), 400, "top_k"),
    ("n zero", C, completion(n=0), 400, "n"),
    ("n 129", C, completion(n=129), 400, "n"),
    ("max_tokens zero", C, completion(max_tokens=0), 400, "max_tokens"),
    ("max_tokens beyond context", C, completion(max_tokens=9000), 400, "max_tokens"),
    ("min_tokens over max_tokens", C, completion(min_tokens=5), 400, "min_tokens"),
    ("logprobs 6", C, completion(logprobs=6), 400, "logprobs"),
    ("logit_bias 101", C, completion(logit_bias={"5": 101}), 400, "logit_bias"),
    ("logit_bias key not an id", C, completion(logit_bias={"five": 1}), 400, "logit_bias"),
    ("logit_bias id outside vocab", C, completion(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("17 stop strings", C, completion(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("empty stop string", C, completion(stop=""), 400, "stop"),
    ("stop string 2k chars", C, completion(stop="x" * 2000), 400, "stop"),
    ("stop_token_ids outside vocab", C, completion(stop_token_ids=[10**6]), 400, "stop_token_ids"),
    ("prompt ids outside vocab", C, completion(prompt=[1, 99999999]), 400, "prompt"),
    ("prompt id 2^70", C, completion(prompt=[2**70]), 400, "prompt"),
    ("negative prompt id", C, completion(prompt=[-1]), 400, "prompt"),
    ("empty prompt", C, completion(prompt=""), 400, "prompt"),
    ("two prompts", C, completion(prompt=["a", "b"]), 400, "prompt"),
    ("vllm_xargs int 2^70", C, completion(vllm_xargs={"k": [2**70]}), 400, "vllm_xargs"),
    ("suffix", C, completion(suffix="!"), 400, "suffix"),
    ("stream_options without stream", C, completion(stream_options={"include_usage": True}), 400, "stream_options"),
    ("user message without content", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    ("no messages", CHAT, chat(messages=[]), 400, "messages"),
    ("image content part", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]),
     400, "messages[0].content[0]"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("top_logprobs 21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("tools with auto tool choice", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tool_choice"),
    ("max_completion_tokens zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("body over the size limit", C, completion(prompt="x" * (17 * 2**20)), 413, "request_too_large"),
    ("no such route", "/v1/embeddings", completion(), 404, "not_found"),
]  # fmt: skip


@pytest.fixture(scope="module")
def http(default_server: Server) -> httpx.Client:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=default_server.url, headers=headers, timeout=60) as client:
        yield client


@pytest.mark.parametrize(("name", "path", "body", "status", "names"), CASES, ids=[case[0] for case in CASES])
def test_a_malformed_request_gets_its_4xx_naming_the_field(
    http: httpx.Client, name: str, path: str, body: bytes, status: int, names: str | None
) -> None:
    response = http.post(path, content=body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "\n" not in error["message"]
    if names is not None:
        assert names in (error["param"], error["code"]), error


def test_there_are_at_least_30_cases() -> None:
    assert len(CASES) >= 30


def test_the_server_still_serves_after_every_malformed_request(http: httpx.Client) -> None:
    for path, body in ((C, completion()), (CHAT, chat())):
        response = http.post(path, content=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_wrong_method_is_405_in_openais_shape(http: httpx.Client) -> None:
    response = http.delete("/v1/models")
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"
