"""``/openapi.json``: the API as served, for clients, docs and schema-driven testers (schemathesis).

Request bodies are protocol.py's msgspec structs, the very types the server
decodes with, so their schema cannot drift from what is accepted. Response
bodies are described by the structs below; protocol.py's builders produce
plain dicts of these shapes, and tests check the two agree (every builder's
output converts to its struct, and a schemathesis run validates responses).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from tokenmill.server import protocol

# ---------------------------------------------------------------- response shapes


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """Every error, OpenAI's shape."""

    error: ErrorDetail


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct):
    """Per returned token: its text, logprob, top alternatives, and where it starts in the returned text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's ``prompt_logprobs`` entry: a prompt token's (or alternative's) logprob, rank and text."""

    logprob: float
    rank: int | None
    decoded_token: str


FinishReason = Literal["stop", "length"]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Model(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[Model]


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class Health(msgspec.Struct):
    status: str
    reasons: list[str] | None = None


class Version(msgspec.Struct):
    version: str


# ---------------------------------------------------------------- the document

_ERRORS = {
    "400": "The request is invalid; `error.param` names the field.",
    "401": "Missing or wrong API key.",
    "404": "No such model.",
    "413": "The request body is larger than `server.max_request_body`.",
    "429": "The server is at capacity, or the API key is over one of its limits; retry after `Retry-After` seconds "
    "when the response has that header.",
    "503": "No engine is available (restarting, or the server is shutting down).",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(name)}}


def _operation(summary: str, ok: dict[str, Any], *, body: str | dict[str, Any] | None = None,
               errors: tuple[str, ...] = (), auth: bool = False) -> dict[str, Any]:  # fmt: skip
    """One operation: ``ok`` is the 200 response's content, ``body`` the request body's schema (or its name),
    ``errors`` the statuses it may answer with an ErrorResponse; ``auth`` puts it behind the API key."""
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    for status in ("401", *errors) if auth else errors:
        responses[status] = {"description": _ERRORS[status], "content": _json("ErrorResponse")}
    operation: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        schema = _ref(body) if isinstance(body, str) else body
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    operation["security"] = [{"bearerAuth": []}] if auth else []
    return operation


def openapi_document(version: str, models: list[str], *, api_key: bool, public_metrics: bool) -> dict[str, Any]:
    """The OpenAPI 3.1 description of every route ``build_app`` serves, as configured: ``models`` are the names
    a request's ``model`` may take, and with ``api_key`` every route but /health (and /metrics with
    ``public_metrics``) takes the key as a bearer token."""
    structs = (
        protocol.CompletionRequest, protocol.ChatCompletionRequest, protocol.TokenizeCompletionRequest,
        protocol.TokenizeChatRequest, protocol.DetokenizeRequest, ErrorResponse, Completion, ChatCompletion,
        ModelList, Model, TokenizeResponse, DetokenizeResponse, Health, Version,
    )  # fmt: skip
    _, schemas = msgspec.json.schema_components(structs, ref_template="#/components/schemas/{name}")
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schemas[name]["properties"]["model"]["enum"] = models  # any other name is a 404
    generate = ("400", "404", "413", "429", "503")
    tokenize_body = {"oneOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]}
    # The schema of one event, as OpenAPI 3.1 tools read it for text/event-stream (3.2 calls it itemSchema).
    event = {
        "type": "object", "required": ["data"],
        "properties": {
            "data": {"type": "string", "contentMediaType": "application/json",
                     "description": "A chunk object (`text_completion` or `chat.completion.chunk`), an error "
                                    "object, or `[DONE]` last"},
            "event": {"const": "message"},
        },
    }  # fmt: skip
    events = {"text/event-stream": {"schema": event}}
    text = {"text/plain": {"schema": {"type": "string"}}}
    model_id = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
    health = _operation("Ready to serve (200) or not (503)", _json("Health"))
    health["responses"]["503"] = {"description": "Not ready", "content": _json("Health")}
    return {
        "openapi": "3.1.0",
        "info": {"title": "tokenmill", "version": version,
                 "description": "OpenAI-compatible API (completions, chat) plus vLLM's tokenize/detokenize."},
        "paths": {
            "/v1/completions": {"post": _operation(
                "Create a completion", {**_json("Completion"), **events}, body="CompletionRequest",
                errors=generate, auth=api_key)},
            "/v1/chat/completions": {"post": _operation(
                "Create a chat completion", {**_json("ChatCompletion"), **events}, body="ChatCompletionRequest",
                errors=generate, auth=api_key)},
            "/v1/models": {"get": _operation("List the served models", _json("ModelList"), auth=api_key)},
            "/v1/models/{model_id}": {"get": {
                **_operation("Retrieve a model", _json("Model"), errors=("404",), auth=api_key),
                "parameters": [model_id]}},
            "/tokenize": {"post": _operation(
                "Tokenize a prompt or a conversation (vLLM)", _json("TokenizeResponse"), body=tokenize_body,
                errors=("400", "404", "413"), auth=api_key)},
            "/detokenize": {"post": _operation(
                "Detokenize token ids (vLLM)", _json("DetokenizeResponse"), body="DetokenizeRequest",
                errors=("400", "404", "413"), auth=api_key)},
            "/health": {"get": health},
            "/version": {"get": _operation("The server's version", _json("Version"), auth=api_key)},
            "/metrics": {"get": _operation("Prometheus metrics (docs/metrics.md)", text,
                                           auth=api_key and not public_metrics)},
            "/openapi.json": {"get": _operation("This document", {"application/json": {"schema": {}}},
                                                auth=api_key)},
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }  # fmt: skip
