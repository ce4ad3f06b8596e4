"""The OpenAI-compatible HTTP API (Starlette, run by uvicorn).

A request is validated and tokenized here, sent to an engine chosen by the
routing policy, and its token deltas are turned into text (incremental
detokenization, stop strings) beside the tokenizer. Errors are OpenAI-shaped
JSON. A client that goes away aborts its request in the engine, which frees
its KV blocks. Imports no torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenmill import __version__
from tokenmill.config import EngineConfig
from tokenmill.engine_client import EngineDeadError, EngineGroup, RequestStream, RouterError
from tokenmill.messages import EngineCoreOutput, EngineCoreRequest
from tokenmill.output_processor import CompletionDelta, OutputProcessor
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server import protocol
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import ProtocolError
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    config: EngineConfig
    group: EngineGroup
    tokenizer: Tokenizer
    model_name: str
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    is_draining: bool = False


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its generator however the response ends. When a client disconnects, Starlette
    just stops iterating; closing runs the generators' ``finally`` now (aborting the request and
    freeing its KV blocks) instead of whenever the garbage collector finalises them."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Our endpoints stream async generators, which have aclose (Starlette types the body as any
            # async iterable).
            body = self.body_iterator
            assert isinstance(body, AsyncGenerator)
            await body.aclose()


def _error(exc: ProtocolError, metrics: ServerMetrics) -> JSONResponse:
    metrics.observe_rejected(exc.status, exc.code)
    return Response(
        protocol.error_body(exc.status, exc.message, exc.type, exc.param, exc.code),
        status_code=exc.status,
        media_type="application/json",
    )  # type: ignore[return-value]


@dataclass
class _Generation:
    """One request in flight: its engine stream and the text built from it."""

    request_id: str
    stream: RequestStream
    processor: OutputProcessor
    output: RequestOutput
    params: SamplingParams
    arrival: float
    last_token_at: dict[int, float] = field(default_factory=dict)  # by completion index
    first_token_at: float | None = None
    queue_time: float = 0.0  # in the engine, before its first step


class OpenAIServer:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    # ------------------------------------------------------------------ plumbing

    def _check_auth(self, request: Request) -> None:
        key = self.state.config.server.api_key
        if key is not None and request.headers.get("authorization") != f"Bearer {key}":
            raise ProtocolError(
                401, "Incorrect API key provided.", type="invalid_request_error", code="invalid_api_key"
            )

    def _check_model(self, model: str) -> None:
        if model != self.state.model_name:
            raise protocol.model_not_found(model)

    def _check_capacity(self) -> None:
        if self.state.is_draining:
            raise ProtocolError(503, "The server is shutting down.", type="server_error", code="shutting_down")
        group = self.state.group
        if not group.is_serving:  # some engine up: the router skips those that are down
            raise ProtocolError(
                503, "No engine is available (restarting); retry later.", type="server_error",
                code="engine_unavailable",
            )  # fmt: skip
        if group.num_in_flight >= group.max_num_seqs + self.state.config.server.max_waiting:
            raise ProtocolError(
                429, "The server is at capacity; retry later.", type="rate_limit_error", code="queue_full"
            )

    def _start(self, prompt_token_ids: list[int], prompt: str | None, params: SamplingParams, priority: int,
               prefix: str) -> _Generation:  # fmt: skip
        self._check_capacity()
        vocab_size = self.state.tokenizer.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise ProtocolError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        arrival = time.monotonic()
        message = EngineCoreRequest(
            request_id, prompt_token_ids, params, list(self.state.tokenizer.eos_token_ids), arrival, priority
        )
        try:
            stream = self.state.group.add_request(message)
        except EngineDeadError as exc:
            raise ProtocolError(503, str(exc), type="server_error", code="engine_unavailable") from None
        except RouterError as exc:  # a plugin's bug: this request fails, the server keeps serving
            raise ProtocolError(500, str(exc), type="server_error", code="router_error") from None
        processor = OutputProcessor(self.state.tokenizer)
        output = processor.add_request(request_id, prompt, prompt_token_ids, params)
        return _Generation(request_id, stream, processor, output, params, arrival)

    async def _updates(self, generation: _Generation) -> AsyncGenerator[list[CompletionDelta]]:
        """Yield the text deltas of every engine output until the request finishes; ``generation.output``
        holds the whole request as it grows.

        Raises ``ProtocolError`` 503 if the engine dies and 400 if the engine refused the request.
        """
        metrics = self.state.metrics
        client = generation.stream.client
        try:
            while True:
                item = await generation.stream.queue.get()
                if isinstance(item, EngineDeadError):
                    metrics.observe_unfinished(client.index, "error")
                    raise ProtocolError(503, str(item), type="server_error", code="engine_unavailable")
                if item.error is not None:
                    raise ProtocolError(400, item.error)
                self._observe(generation, item)
                step = generation.processor.process([item])
                if step.to_abort:
                    client.abort(step.to_abort, completions_only=True)
                yield step.deltas
                if generation.output.finished:
                    self._observe_finished(generation)
                    return
        finally:
            if not generation.output.finished and not client.is_dead:
                # The client went away (or the handler failed): stop all its completions and free the blocks.
                client.abort([generation.request_id])
                metrics.observe_unfinished(client.index, "abort")
            client.release(generation.request_id)

    def _observe(self, generation: _Generation, output: EngineCoreOutput) -> None:
        metrics, engine = self.state.metrics, generation.stream.client.index
        if output.queue_time is not None:
            generation.queue_time = output.queue_time
            metrics.observe_queue_time(engine, output.queue_time)
        if output.new_token_ids:
            now = time.monotonic()
            metrics.observe_token(engine, now, generation.arrival, generation.last_token_at.get(output.index))
            generation.last_token_at[output.index] = now
            if generation.first_token_at is None:
                generation.first_token_at = now

    def _observe_finished(self, generation: _Generation) -> None:
        metrics, engine = self.state.metrics, generation.stream.client.index
        reasons = {c.finish_reason for c in generation.output.outputs}
        if not reasons & {"stop", "length"}:  # the engine aborted every completion
            metrics.observe_unfinished(engine, "abort")
            return
        metrics.observe_finished(
            engine, "stop" if "stop" in reasons else "length", generation.arrival, generation.queue_time,
            generation.first_token_at, max(generation.last_token_at.values(), default=None), time.monotonic(),
        )  # fmt: skip

    async def _until_finished(self, request: Request, generation: _Generation) -> RequestOutput:
        """Consume the whole generation, aborting it if the client disconnects meanwhile."""

        async def consume() -> RequestOutput:
            async with aclosing(self._updates(generation)) as updates:
                async for _ in updates:
                    pass
            return generation.output

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        consumer = asyncio.create_task(consume())
        watcher = asyncio.create_task(disconnected())
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer not in done:
            consumer.cancel()  # runs _updates' finally: the request is aborted in the engine
            await asyncio.gather(consumer, return_exceptions=True)
            raise ProtocolError(499, "client disconnected")
        watcher.cancel()
        return consumer.result()

    # ------------------------------------------------------------------ endpoints

    async def completions(self, request: Request) -> Response:
        try:
            self._check_auth(request)
            body, params = protocol.decode_completion_request(await request.body())
            self._check_model(body.model)
            prompt = protocol.completion_prompt(body)
            if isinstance(prompt, str):
                prompt_text: str | None = prompt
                token_ids = self.state.tokenizer.encode(prompt)
            else:
                prompt_text, token_ids = None, list(prompt)
            return await self._respond(
                request, body, params, prompt_text, token_ids, "cmpl", body.logprobs,
                self._stream_completion, protocol.completion_response,
            )  # fmt: skip
        except ProtocolError as exc:
            return _error(exc, self.state.metrics)

    async def chat_completions(self, request: Request) -> Response:
        try:
            self._check_auth(request)
            body, params = protocol.decode_chat_request(await request.body())
            self._check_model(body.model)
            messages = protocol.chat_messages(body)
            try:
                prompt_text = self.state.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except ValueError as exc:
                raise ProtocolError(400, str(exc).splitlines()[0], param="messages") from None
            assert isinstance(prompt_text, str)
            token_ids = self.state.tokenizer.encode(prompt_text, add_special_tokens=False)
            top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
            return await self._respond(
                request, body, params, prompt_text, token_ids, "chatcmpl", top_logprobs,
                self._stream_chat, protocol.chat_response,
            )  # fmt: skip
        except ProtocolError as exc:
            return _error(exc, self.state.metrics)

    async def _respond(
        self,
        request: Request,
        body: protocol.CompletionRequest | protocol.ChatCompletionRequest,
        params: SamplingParams,
        prompt_text: str | None,
        token_ids: list[int],
        id_prefix: str,
        num_top_logprobs: int | None,
        stream: Callable[[_Generation, bool, int | None], AsyncIterator[bytes]],
        build_response: Callable[..., dict[str, Any]],
    ) -> Response:
        """What both endpoints do once the prompt is tokenized: start, then stream or wait and answer."""
        protocol.check_context_length(body, params, len(token_ids), self.state.group.max_model_len)
        generation = self._start(token_ids, prompt_text, params, body.priority, id_prefix)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _ClosingStreamingResponse(
                stream(generation, include_usage, num_top_logprobs), media_type="text/event-stream"
            )
        output = await self._until_finished(request, generation)
        return JSONResponse(
            build_response(
                generation.request_id,
                self.state.model_name,
                self.state.created,
                output,
                len(token_ids),
                num_top_logprobs=num_top_logprobs,
            )  # fmt: skip
        )

    async def _stream_text(self, generation: _Generation) -> AsyncGenerator[CompletionDelta]:
        """Each completion's deltas as the output processor releases them (it holds back stop strings)."""
        async with aclosing(self._updates(generation)) as updates:
            async for deltas in updates:
                for delta in deltas:
                    yield delta

    async def _stream_completion(
        self, generation: _Generation, include_usage: bool, num_top_logprobs: int | None
    ) -> AsyncIterator[bytes]:
        model, created = self.state.model_name, self.state.created
        try:
            async with aclosing(self._stream_text(generation)) as deltas:
                async for delta in deltas:
                    logprobs = None
                    if delta.logprobs is not None:
                        logprobs = protocol.completion_logprobs(
                            delta.token_ids, delta.logprobs, text_offset=delta.text_offset,
                            num_top_logprobs=num_top_logprobs,
                        )  # fmt: skip
                    chunk = protocol.completion_chunk(
                        generation.request_id, model, created, delta.index, delta.text, delta.finish_reason, logprobs
                    )
                    yield protocol.sse_event(chunk)
            if include_usage:
                yield protocol.sse_event(self._usage_chunk(generation, "text_completion"))
        except ProtocolError as exc:
            yield protocol.sse_event(protocol.error_dict(exc.status, exc.message, exc.type, exc.param, exc.code))
        yield protocol.SSE_DONE

    async def _stream_chat(
        self, generation: _Generation, include_usage: bool, num_top_logprobs: int | None
    ) -> AsyncIterator[bytes]:
        model, created, request_id = self.state.model_name, self.state.created, generation.request_id
        try:
            for index in range(generation.params.n):
                role = {"role": "assistant", "content": ""}
                yield protocol.sse_event(protocol.chat_chunk(request_id, model, created, index, role))
            async with aclosing(self._stream_text(generation)) as deltas:
                async for delta in deltas:
                    if delta.text or delta.token_ids:
                        logprobs = None
                        if delta.logprobs is not None:
                            logprobs = protocol.chat_logprobs(
                                delta.token_ids, delta.logprobs, num_top_logprobs=num_top_logprobs,
                            )  # fmt: skip
                        content = {"content": delta.text}
                        chunk = protocol.chat_chunk(request_id, model, created, delta.index, content, None, logprobs)
                        yield protocol.sse_event(chunk)
                    if delta.finish_reason is not None:
                        chunk = protocol.chat_chunk(request_id, model, created, delta.index, {}, delta.finish_reason)
                        yield protocol.sse_event(chunk)
            if include_usage:
                yield protocol.sse_event(self._usage_chunk(generation, "chat.completion.chunk"))
        except ProtocolError as exc:
            yield protocol.sse_event(protocol.error_dict(exc.status, exc.message, exc.type, exc.param, exc.code))
        yield protocol.SSE_DONE

    def _usage_chunk(
        self, generation: _Generation, kind: Literal["text_completion", "chat.completion.chunk"]
    ) -> dict[str, Any]:
        prompt_tokens = len(generation.output.prompt_token_ids)
        completion_tokens = sum(len(c.token_ids) for c in generation.output.outputs)
        return protocol.usage_chunk(
            generation.request_id, self.state.model_name, self.state.created, kind, prompt_tokens, completion_tokens
        )

    async def models(self, request: Request) -> Response:
        try:
            self._check_auth(request)
        except ProtocolError as exc:
            return _error(exc, self.state.metrics)
        return JSONResponse(protocol.models_response([self.state.model_name], self.state.created))

    async def health(self, request: Request) -> Response:
        """200 ``ok`` when every engine is up; 200 ``degraded`` while some are down and the others serve; 503
        ``engine down`` while none can serve (restarting), and ``draining`` once the server is stopping."""
        group = self.state.group
        if group.is_healthy and not self.state.is_draining:
            return JSONResponse({"status": "ok"})
        engines = [
            {"index": c.index, "status": c.status, "num_restarts": c.num_restarts, "reason": c.death_reason or None}
            for c in group.clients
        ]
        reasons = [c.death_reason for c in group.clients if c.is_dead]
        if self.state.is_draining:
            status, code = "draining", 503
        elif group.is_serving:
            status, code = "degraded", 200
        else:
            status, code = "engine down", 503
        return JSONResponse({"status": status, "reasons": reasons, "engines": engines}, status_code=code)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def build_app(state: ServerState) -> Starlette:
    server = OpenAIServer(state)
    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/version", server.version, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes)
