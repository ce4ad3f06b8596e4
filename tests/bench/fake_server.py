"""A small OpenAI-compatible streaming server for the serve benchmark's tests.

It streams ``max_tokens`` tokens, two per chunk, after a fixed delay for the
first chunk and a fixed delay between chunks, then a usage chunk and ``[DONE]``.
With ``inject_failures`` every 5th request gets a 500 and every 7th fails in the
middle of its stream. A chat request that does not stream gets the same text at
once, whatever its ``response_format`` or ``tools`` ask: a server that ignores them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "fake-model"
FIRST_CHUNK_DELAY = 0.05  # s: the "prefill"
CHUNK_DELAY = 0.04  # s between chunks
TOKENS_PER_CHUNK = 2  # so each token is CHUNK_DELAY / 2 apart


@dataclass
class FakeServerState:
    inject_failures: bool = True
    bodies: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # time.perf_counter() when each request came in
    headers: list[dict[str, str]] = field(default_factory=list)

    def reset(self, inject_failures: bool = True) -> None:
        self.inject_failures = inject_failures
        self.bodies.clear()
        self.arrivals.clear()
        self.headers.clear()


def make_app(state: FakeServerState) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(request: Request) -> Response:
        body = await request.json()
        index = len(state.bodies)
        state.bodies.append(body)
        state.arrivals.append(time.perf_counter())
        state.headers.append(dict(request.headers))
        if state.inject_failures and index % 5 == 4:
            return JSONResponse({"error": {"message": "injected failure", "code": 500}}, status_code=500)
        is_chat = request.url.path.endswith("/chat/completions")
        if is_chat:
            num_prompt_tokens = sum(len(m["content"].split()) for m in body["messages"])
        else:
            num_prompt_tokens = len(body["prompt"])
        if is_chat and not body.get("stream"):
            message = {"role": "assistant", "content": " tok" * body["max_tokens"]}
            return JSONResponse({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})
        breaks = state.inject_failures and index % 7 == 6
        return StreamingResponse(
            _stream(body["max_tokens"], num_prompt_tokens, is_chat, breaks), media_type="text/event-stream"
        )

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", completions, methods=["POST"]),
        ]
    )


async def _stream(max_tokens: int, num_prompt_tokens: int, is_chat: bool, breaks: bool) -> AsyncIterator[str]:
    await asyncio.sleep(FIRST_CHUNK_DELAY)
    sent = 0
    while sent < max_tokens:
        if sent:
            await asyncio.sleep(CHUNK_DELAY)
        count = min(TOKENS_PER_CHUNK, max_tokens - sent)
        text = " tok" * count
        choice = {"index": 0, "delta": {"content": text}} if is_chat else {"index": 0, "text": text}
        yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        sent += count
        if breaks:
            yield f"data: {json.dumps({'error': {'message': 'engine died'}})}\n\n"
            return
    usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": sent, "total_tokens": num_prompt_tokens + sent}
    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


@contextmanager
def serve_fake(state: FakeServerState) -> Iterator[str]:
    """Run the fake server on a free 127.0.0.1 port in a thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the port is ours before uvicorn starts: no race for it
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()
