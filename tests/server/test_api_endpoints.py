"""The endpoints besides completions and chat: /v1/models/{id}, vLLM's /tokenize and /detokenize, /openapi.json,
and which of them the API key guards; then a bounded schemathesis run against the served schema."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.server.conftest import API_KEY, Server, free_port, start_tiny_server
from tokenmill.server.openapi import ChatCompletion, Completion, ModelList, TokenizeResponse
from tokenmill.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.fixture(scope="module")
def http(default_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=default_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def test_retrieve_a_model_by_id(http: httpx.Client, default_server: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.retrieve(default_server.model)
    assert (model.id, model.object, model.owned_by) == (default_server.model, "model", "tokenmill")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("org/no-such-model")
    assert caught.value.response.json()["error"]["code"] == "model_not_found"


def test_tokenize_and_detokenize_a_prompt(http: httpx.Client, default_server: Server, smollm2_gguf: Path) -> None:
    tokenizer = Tokenizer.from_path(smollm2_gguf)
    text = "Tea 🍵 or coffee?"
    response = http.post("/tokenize", json={"model": default_server.model, "prompt": text, "return_token_strs": True})
    assert response.status_code == 200, response.text
    body = msgspec.convert(response.json(), TokenizeResponse)
    assert body.tokens == tokenizer.encode(text) and body.count == len(body.tokens)
    assert body.max_model_len == 8192 and body.token_strs == tokenizer.convert_ids_to_tokens(body.tokens)
    back = http.post("/detokenize", json={"model": default_server.model, "tokens": body.tokens})
    assert back.json() == {"prompt": text}
    outside = http.post("/detokenize", json={"tokens": [1, 10**6]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"


def test_tokenize_chat_messages_as_the_chat_endpoint_sees_them(http: httpx.Client, default_server: Server) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    chat = http.post("/v1/chat/completions", json={"model": default_server.model, "messages": messages,
                                                  "max_tokens": 1})  # fmt: skip
    assert chat.json()["usage"]["prompt_tokens"] == len(tokens)
    without_prompt = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert without_prompt["count"] < len(tokens)
    bad = http.post("/tokenize", json={"messages": [{"role": "user"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].content"


def test_what_the_api_key_guards(default_server: Server) -> None:
    open_routes = {("GET", "/health"), ("GET", "/metrics")}  # /metrics: server.public_metrics (the default)
    routes = {("GET", "/v1/models"), ("GET", f"/v1/models/{default_server.model}"), ("GET", "/version"),
              ("GET", "/openapi.json"), ("POST", "/tokenize"), ("POST", "/detokenize"),
              ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}  # fmt: skip
    for method, path in routes | open_routes:
        response = httpx.request(method, f"{default_server.url}{path}", json={})
        if (method, path) in open_routes:
            assert response.status_code == 200, path
        else:
            assert response.status_code == 401, path
            assert response.json()["error"]["code"] == "invalid_api_key"


def test_openapi_describes_every_route_as_served(http: httpx.Client, default_server: Server) -> None:
    document = http.get("/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                      "/v1/models/{model_id}", "/tokenize", "/detokenize", "/health", "/version",
                                      "/metrics", "/openapi.json"}  # fmt: skip
    schemas = document["components"]["schemas"]
    assert schemas["CompletionRequest"]["properties"]["model"]["enum"] == [default_server.model]
    assert document["paths"]["/health"]["get"]["security"] == []
    # Responses as served convert to the structs the document is built from.
    completion = http.post("/v1/completions", json={"model": default_server.model, "prompt": "Hi", "max_tokens": 3,
                                                    "logprobs": 2})  # fmt: skip
    msgspec.convert(completion.json(), Completion)
    messages = [{"role": "user", "content": "Hi"}]
    chat = http.post("/v1/chat/completions", json={"model": default_server.model, "max_tokens": 3, "logprobs": True,
                                                   "top_logprobs": 2, "messages": messages})  # fmt: skip
    msgspec.convert(chat.json(), ChatCompletion)
    msgspec.convert(http.get("/v1/models").json(), ModelList)


# ---------------------------------------------------------------- schemathesis

# Checks that hold for this API: no 5xx, statuses and content types as documented, bodies matching their
# schemas, auth enforced. Left out: positive_data_acceptance, since a JSON schema cannot say everything the server
# checks (a tool message needs content, min_tokens <= max_tokens, token ids against the vocabulary, 1.0 where
# an integer is expected), so some schema-valid bodies are rightly refused with a 400.
SCHEMATHESIS_CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
    "response_headers_conformance,negative_data_rejection,missing_required_header,ignored_auth"
)


@pytest.fixture(scope="module")
def small_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, smollm2_gguf: Path
) -> Iterator[Server]:
    """A tiny model with a short context, so the longest completion a fuzzer can ask for stays quick."""
    server = start_tiny_server(
        tmp_path_factory.mktemp("schemathesis"), tiny_model_dir, smollm2_gguf, "--api-key", API_KEY,
        "--max-model-len", "96", "--max-num-seqs", "256",
    )  # fmt: skip
    yield server
    server.stop()


def test_schemathesis_finds_no_5xx_and_no_schema_violation(small_server: Server, tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    result = _schemathesis(f"{small_server.url}/openapi.json", report)
    assert result.returncode == 0, result.stdout[-6000:]
    assert report.exists()
    # The server is still serving afterwards.
    assert httpx.get(f"{small_server.url}/health").json() == {"status": "ok"}


def _schemathesis(schema_url: str, report: Path) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", schema_url,
        "--header", f"Authorization: Bearer {API_KEY}", "--checks", SCHEMATHESIS_CHECKS,
        "--max-examples", "40", "--seed", "1", "--generation-deterministic", "--request-timeout", "60",
        "--phases", "examples,coverage,fuzzing", "--report", "junit", "--report-junit-path", str(report),
    ]  # fmt: skip
    # In the report's folder: schemathesis keeps its state in ./.schemathesis.
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=report.parent)


def test_a_planted_server_error_fails_the_same_run(tmp_path: Path) -> None:
    """The run above could fail: the same command against an app that answers large ``n`` with a 500 reports it."""

    async def create(request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {API_KEY}":
            return JSONResponse({"error": "no key"}, status_code=401)
        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("n"), int) or isinstance(body.get("n"), bool):
            return JSONResponse({"error": "bad"}, status_code=400)
        if body["n"] > 5:
            return Response("boom", status_code=500)
        return JSONResponse({"n": body["n"]})

    document = {
        "openapi": "3.1.0", "info": {"title": "planted", "version": "1"},
        "security": [{"bearerAuth": []}],
        "components": {"securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}}},
        "paths": {"/create": {"post": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                "additionalProperties": False}}}},
            "responses": {
                "200": {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}},
                "400": {"description": "bad", "content": {"application/json": {"schema": {"type": "object"}}}},
                "401": {"description": "key", "content": {"application/json": {"schema": {"type": "object"}}}},
            }}}},
    }  # fmt: skip

    async def schema(request: Request) -> Response:
        return JSONResponse(document)

    app = Starlette(routes=[Route("/create", create, methods=["POST"]), Route("/openapi.json", schema)])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        result = _schemathesis(f"http://127.0.0.1:{port}/openapi.json", tmp_path / "junit.xml")
    finally:
        server.should_exit = True
        thread.join(10)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "Server error" in result.stdout
