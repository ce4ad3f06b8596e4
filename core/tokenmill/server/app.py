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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenmill import __version__
from tokenmill.config import EngineConfig
from tokenmill.engine_client import EngineDeadError, EngineGroup
from tokenmill.lora.request import LoRARequest
from tokenmill.messages import EngineCoreOutput, EngineCoreRequest
from tokenmill.output_processor import CompletionDelta, OutputProcessor
from tokenmill.outputs import RequestOutput
from tokenmill.plugin_manager import PluginError, PluginSystem
from tokenmill.sampling_params import SamplingParams
from tokenmill.server import protocol, streaming
from tokenmill.server.lora import LoRAEndpoints
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.openapi import openapi_document
from tokenmill.server.parsing import OutputParsing, ServerParsers
from tokenmill.server.protocol import ProtocolError
from tokenmill.server.streaming import Generation
from tokenmill.server.tenants import KeyState, Lease, RateLimited, Tenants
from tokenmill.structured_output.validator import ConstraintValidator
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: Retry-After of a 503 while engines restart: a restarted engine reloads its model, which takes seconds.
ENGINE_RESTART_RETRY_AFTER_S = 5


@dataclass
class ServerState:
    config: EngineConfig
    group: EngineGroup
    tokenizer: Tokenizer
    model_name: str
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    is_draining: bool = False
    #: Keys, tenants and their limits; None: built from ``config.server`` (``Tenants.from_config``).
    tenants: Tenants | None = None
    #: The front end's plugins: its structured-output backend checks constraints before requests are accepted
    #: (None: the engines' compile reports a bad constraint).
    plugins: PluginSystem | None = None


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its generator however the response ends. When a client disconnects, Starlette
    just stops iterating; closing runs the generators' ``finally`` now (aborting the request and
    freeing its KV blocks) instead of whenever the garbage collector finalises them. ``on_close`` callbacks
    run then too (a tenant's concurrency slot is released when its stream ends)."""

    on_close: list[Callable[[], None]]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Our endpoints stream async generators, which have aclose (Starlette types the body as any
            # async iterable).
            body = self.body_iterator
            assert isinstance(body, AsyncGenerator)
            try:
                await body.aclose()
            finally:
                for callback in getattr(self, "on_close", ()):
                    callback()


def _error(exc: ProtocolError, metrics: ServerMetrics, tenant: str | None = None) -> JSONResponse:
    """OpenAI's JSON error for ``exc``, counted (for ``tenant`` too, when the key is known), with ``Retry-After``
    when the error will pass (a rate limit, a full queue, engines restarting)."""
    limit = exc.limit if isinstance(exc, RateLimited) else None
    metrics.observe_rejected(exc.status, exc.code, tenant, limit)
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return Response(
        protocol.error_body(exc.status, exc.message, exc.type, exc.param, exc.code),
        status_code=exc.status,
        media_type="application/json",
        headers=headers,
    )  # type: ignore[return-value]


Endpoint = Callable[[Request], Awaitable[Response]]


class OpenAIServer:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        config = state.config.server
        if state.tenants is None:
            state.tenants = Tenants.from_config(config)
        self.tenants = state.tenants
        state.metrics.add_tenants(self.tenants.names)
        document = openapi_document(
            __version__, [state.model_name], api_key=self.tenants.requires_key, public_metrics=config.public_metrics
        )
        self._openapi = msgspec.json.encode(document)  # encoded once: it never changes while serving
        #: With ``lora.enable_lora``: the adapters served, by name.
        self.lora = LoRAEndpoints.from_config(state.config, state.model_name, self.tenants)
        #: Checks constraints before requests are accepted (with the front end's plugins); its backend is built a
        #: second after start-up, not beside the engine's steps when the first constrained request comes.
        self._validator: ConstraintValidator | None = None
        if state.plugins is not None:
            backend = state.config.structured_outputs_config.backend
            self._validator = ConstraintValidator(state.plugins, backend, state.tokenizer, state.tokenizer.vocab_size)
            self._validator.prepare(delay_s=1.0)
        #: ``--tool-call-parser`` and ``--reasoning-parser``, with ``--enable-auto-tool-choice``.
        self.parsers = ServerParsers(state.config, state.plugins, state.tokenizer)

    # ------------------------------------------------------------------ plumbing

    def endpoint(self, handler: Endpoint, *, auth: bool = True, limited: bool = False) -> Endpoint:
        """``handler`` as a route: behind the API keys (unless ``auth`` is false), within the key's limits
        (``limited``: generation endpoints; the request holds a ``Lease`` in ``request.state.lease`` until its
        response, or its stream, ends), and every ``ProtocolError`` it raises answered as OpenAI's JSON error."""

        async def route(request: Request) -> Response:
            key: KeyState | None = None
            lease: Lease | None = None
            try:
                if auth:
                    key = self.tenants.authenticate(request.headers.get("authorization"))
                    request.state.key = key
                if limited:
                    assert key is not None, "a limited route is behind the keys"
                    lease = self.tenants.admit(key)
                    request.state.lease = lease
                    self.state.metrics.observe_tenant_request(lease.tenant)
                response = await handler(request)
            except ProtocolError as exc:
                if lease is not None:
                    lease.release()
                return _error(exc, self.state.metrics, key.tenant if key is not None else None)
            except BaseException:
                if lease is not None:
                    lease.release()
                raise
            if lease is not None:
                if isinstance(response, _ClosingStreamingResponse):
                    response.on_close = [lease.release]
                else:
                    lease.release()
            return response

        return route

    async def http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's own errors (no such route, wrong method) in OpenAI's shape."""
        assert isinstance(exc, HTTPException)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        response = _error(ProtocolError(exc.status_code, message, code=code), self.state.metrics)
        response.headers.update(exc.headers or {})
        return response

    async def internal_error(self, request: Request, exc: Exception) -> Response:
        """A bug: logged with its traceback, answered as OpenAI's JSON 500; the server keeps serving."""
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        error = ProtocolError(500, f"internal server error ({type(exc).__name__})", code="internal_error")
        return _error(error, self.state.metrics)

    async def _body(self, request: Request) -> bytes:
        """The request body, refused with 413 as soon as it is known to exceed ``server.max_request_body``."""
        limit = self.state.config.server.max_request_body
        too_large = ProtocolError(
            413, f"The request body exceeds the server's limit of {limit} bytes.", code="request_too_large"
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_model(self, model: str, request: Request) -> LoRARequest | None:
        """The LoRA adapter ``model`` names for the request's key (None: the base model); any other name, and
        another tenant's adapter, is OpenAI's 404."""
        if self.lora is not None:
            return self.lora.resolve(model, getattr(request.state, "key", None))
        if model != self.state.model_name:
            raise protocol.model_not_found(model)
        return None

    def _check_capacity(self) -> None:
        if self.state.is_draining:
            raise ProtocolError(503, "The server is shutting down.", type="server_error", code="shutting_down")
        group = self.state.group
        if not group.is_serving:  # some engine up: the router skips those that are down
            raise ProtocolError(
                503, "No engine is available (restarting); retry later.", type="server_error",
                code="engine_unavailable", retry_after=ENGINE_RESTART_RETRY_AFTER_S,
            )  # fmt: skip
        if group.num_in_flight >= group.max_num_seqs + self.state.config.server.max_waiting:
            # When a slot frees depends on how long the running requests generate: 1 s, as for a key's concurrency.
            raise ProtocolError(
                429, "The server is at capacity; retry later.", type="rate_limit_error", code="queue_full",
                retry_after=1,
            )  # fmt: skip

    def _start(self, prompt_token_ids: list[int], prompt: str | None, params: SamplingParams, priority: int,
               prefix: str, lease: Lease | None = None, cache_salt: str | None = None,
               lora_request: LoRARequest | None = None) -> Generation:  # fmt: skip
        protocol.check_token_ids(params, prompt_token_ids, self.state.tokenizer.vocab_size)
        self._check_capacity()
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        arrival = time.monotonic()
        tenant = lease.tenant if lease is not None else None
        salt = self.tenants.cache_salt(tenant, cache_salt) if tenant is not None else cache_salt
        eos_token_ids = list(self.state.tokenizer.eos_token_ids)
        message = EngineCoreRequest(
            request_id, prompt_token_ids, params, eos_token_ids, arrival, priority, salt, lora_request=lora_request
        )
        try:
            stream = self.state.group.add_request(message)
        except EngineDeadError as exc:
            raise ProtocolError(503, str(exc), type="server_error", code="engine_unavailable") from None
        if lease is not None:  # charged once it is sent: tokens_per_minute counts what the engines compute
            lease.charge_tokens(len(prompt_token_ids))
            self.state.metrics.observe_tenant_tokens(lease.tenant, num_prompt_tokens=len(prompt_token_ids))
        processor = OutputProcessor(self.state.tokenizer)
        output = processor.add_request(request_id, prompt, prompt_token_ids, params)
        return Generation(request_id, stream, processor, output, params, arrival, lease=lease)

    async def _updates(self, generation: Generation) -> AsyncGenerator[list[CompletionDelta]]:
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

    def _observe(self, generation: Generation, output: EngineCoreOutput) -> None:
        metrics, engine = self.state.metrics, generation.stream.client.index
        if output.queue_time is not None:
            generation.queue_time = output.queue_time
            metrics.observe_queue_time(engine, output.queue_time)
        if output.new_token_ids:
            if generation.lease is not None:  # generated tokens are charged as they arrive
                generation.lease.charge_tokens(len(output.new_token_ids))
                metrics.observe_tenant_tokens(generation.lease.tenant, num_generation_tokens=len(output.new_token_ids))
            if generation.lora_name is not None:
                metrics.observe_lora_tokens(generation.lora_name, len(output.new_token_ids))
            now = time.monotonic()
            metrics.observe_token(engine, now, generation.arrival, generation.last_token_at.get(output.index))
            generation.last_token_at[output.index] = now
            if generation.first_token_at is None:
                generation.first_token_at = now

    def _observe_finished(self, generation: Generation) -> None:
        metrics, engine = self.state.metrics, generation.stream.client.index
        reasons = {c.finish_reason for c in generation.output.outputs}
        if not reasons & {"stop", "length"}:  # the engine aborted every completion
            metrics.observe_unfinished(engine, "abort")
            return
        metrics.observe_finished(
            engine, "stop" if "stop" in reasons else "length", generation.arrival, generation.queue_time,
            generation.first_token_at, max(generation.last_token_at.values(), default=None), time.monotonic(),
        )  # fmt: skip

    async def _until_finished(self, request: Request, generation: Generation) -> RequestOutput:
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

    async def _check_constraint(
        self, body: protocol.CompletionRequest | protocol.ChatCompletionRequest, params: SamplingParams
    ) -> None:
        """A constraint that cannot compile is the request's 400, naming the field that carried it and the
        problem, before the request reaches an engine (when the backend can check without torch)."""
        constraint = params.structured_outputs
        if constraint is None or self._validator is None:
            return
        if body.response_format is not None and body.response_format.type != "text":
            param = "response_format"
        elif body.structured_outputs is not None:
            param = "structured_outputs"
        else:
            param = "tools"
        try:
            await asyncio.to_thread(self._validator.validate, constraint)
        except (ValueError, PluginError) as exc:
            raise ProtocolError(400, f"{param} cannot be used: {exc}", param=param) from None

    async def completions(self, request: Request) -> Response:
        body, params = protocol.decode_completion_request(await self._body(request))
        self._check_model(body.model, request)
        await self._check_constraint(body, params)
        prompt = protocol.completion_prompt(body)
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            token_ids = self.state.tokenizer.encode(prompt)
        else:
            prompt_text, token_ids = None, list(prompt)
        return await self._respond(
            request, body, params, prompt_text, token_ids, "cmpl", body.logprobs,
            self._stream_completion, protocol.completion_response, echo=bool(body.echo),
        )  # fmt: skip

    async def chat_completions(self, request: Request) -> Response:
        body, params = protocol.decode_chat_request(await self._body(request), self.parsers.auto_tool_choice)
        self._check_model(body.model, request)
        await self._check_constraint(body, params)
        # The template sees the tools (a template that knows them tells the model how to call them), as vLLM's.
        template_tools = msgspec.to_builtins(body.tools) if body.tools else None
        prompt_text = self._chat_prompt(body.messages, True, body.chat_template_kwargs, tools=template_tools)
        token_ids = self.state.tokenizer.encode(prompt_text, add_special_tokens=False)
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        forced = protocol.forced_tool_call(body)
        parsing = self.parsers.for_request(body.tool_choice, bool(body.tools), forced, token_ids)
        params = self.parsers.sampling_params(params, parsing)
        return await self._respond(
            request, body, params, prompt_text, token_ids, "chatcmpl", top_logprobs,
            self._stream_chat, protocol.chat_response, parsing=parsing,
        )  # fmt: skip

    def _chat_prompt(
        self,
        messages: list[protocol.ChatMessage],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        tools: Any = None,
    ) -> str:
        """The conversation through the model's chat template, with the request's ``chat_template_kwargs`` over
        ``--default-chat-template-kwargs`` (vLLM's order); a template that fails is the request's 400."""
        variables = {**self.state.config.server.default_chat_template_kwargs, **(template_kwargs or {})}
        try:
            text = self.state.tokenizer.apply_chat_template(
                protocol.chat_messages(messages), add_generation_prompt=add_generation_prompt, tools=tools,
                **variables,
            )  # fmt: skip
        except ValueError as exc:
            raise ProtocolError(400, str(exc).splitlines()[0], param="messages") from None
        assert isinstance(text, str)
        return text

    async def _respond(
        self,
        request: Request,
        body: protocol.CompletionRequest | protocol.ChatCompletionRequest,
        params: SamplingParams,
        prompt_text: str | None,
        token_ids: list[int],
        id_prefix: str,
        num_top_logprobs: int | None,
        stream: Callable[[Generation, bool, int | None], AsyncIterator[bytes]],
        build_response: Callable[..., dict[str, Any]],
        echo: bool = False,
        parsing: OutputParsing | None = None,
    ) -> Response:
        """What both endpoints do once the prompt is tokenized: start, then stream or wait and answer."""
        protocol.check_context_length(body, params, len(token_ids), self.state.group.max_model_len)
        lease = getattr(request.state, "lease", None)
        lora_request = self._check_model(body.model, request)
        generation = self._start(token_ids, prompt_text, params, body.priority, id_prefix, lease, body.cache_salt,
                                 lora_request)  # fmt: skip
        generation.echo = echo
        generation.model = lora_request.lora_name if lora_request is not None else body.model or self.state.model_name
        if lora_request is not None:
            generation.lora_name = lora_request.lora_name
            self.state.metrics.observe_lora_request(lora_request.lora_name, len(token_ids))
        generation.parsing = parsing
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _ClosingStreamingResponse(
                stream(generation, include_usage, num_top_logprobs), media_type="text/event-stream"
            )
        output = await self._until_finished(request, generation)
        options = {"echo": self._echo(generation)} if echo else {}
        response = build_response(generation.request_id, generation.model, self.state.created, output,
                                  len(token_ids), num_top_logprobs=num_top_logprobs, **options)  # fmt: skip
        if parsing is not None:
            parsing.apply(response)
        return JSONResponse(response)

    def _echo(self, generation: Generation) -> protocol.Echo:
        """The prompt as a completion with ``echo`` returns it (once its first output brought its logprobs)."""
        output = generation.output
        text = output.prompt
        if text is None:
            text = self.state.tokenizer.decode(output.prompt_token_ids)
        tokens = generation.processor.prompt_tokens(output) if generation.params.logprobs is not None else None
        return protocol.Echo(text, tokens)

    async def _stream_text(self, generation: Generation) -> AsyncGenerator[CompletionDelta]:
        """Each completion's deltas as the output processor releases them (it holds back stop strings)."""
        async with aclosing(self._updates(generation)) as updates:
            async for deltas in updates:
                for delta in deltas:
                    yield delta

    def _stream_completion(
        self, generation: Generation, include_usage: bool, num_top_logprobs: int | None
    ) -> AsyncIterator[bytes]:
        return streaming.completion_events(generation, self._stream_text(generation), self.state.created,
                                           include_usage, num_top_logprobs, lambda: self._echo(generation))  # fmt: skip

    def _stream_chat(
        self, generation: Generation, include_usage: bool, num_top_logprobs: int | None
    ) -> AsyncIterator[bytes]:
        return streaming.chat_events(
            generation, self._stream_text(generation), self.state.created, include_usage, num_top_logprobs
        )

    async def models(self, request: Request) -> Response:
        response = protocol.models_response([self.state.model_name], self.state.created)
        if self.lora is not None:
            key = getattr(request.state, "key", None)
            response["data"] += self.lora.model_cards(self.state.created, self.state.model_name, key)
        return JSONResponse(response)

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.state.model_name and self._check_model(model_id, request) is not None:
            assert self.lora is not None
            key = getattr(request.state, "key", None)
            cards = self.lora.model_cards(self.state.created, self.state.model_name, key)
            return JSONResponse(next(card for card in cards if card["id"] == model_id))
        return JSONResponse(protocol.model_response(model_id, self.state.created))

    def _lora_endpoints(self) -> LoRAEndpoints:
        if self.lora is None:
            raise ProtocolError(404, "LoRA adapters are not enabled; start the server with --enable-lora")
        return self.lora

    async def load_lora_adapter(self, request: Request) -> Response:
        return self._lora_endpoints().load(await self._body(request), getattr(request.state, "key", None))

    async def unload_lora_adapter(self, request: Request) -> Response:
        return self._lora_endpoints().unload(await self._body(request), getattr(request.state, "key", None))

    async def tokenize(self, request: Request) -> Response:
        body = protocol.decode_tokenize_request(await self._body(request))
        if body.model is not None:
            self._check_model(body.model, request)
        if isinstance(body, protocol.TokenizeChatRequest):
            text = self._chat_prompt(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        else:
            text = body.prompt
        tokens = self.state.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        token_strs = self.state.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return JSONResponse(protocol.tokenize_response(tokens, self.state.group.max_model_len, token_strs))

    async def detokenize(self, request: Request) -> Response:
        body = protocol.decode_detokenize_request(await self._body(request))
        if body.model is not None:
            self._check_model(body.model, request)
        protocol.check_token_ids(SamplingParams(), body.tokens, self.state.tokenizer.vocab_size, param="tokens")
        return JSONResponse({"prompt": self.state.tokenizer.decode(body.tokens)})

    async def openapi(self, request: Request) -> Response:
        return Response(self._openapi, media_type="application/json")

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
    """The HTTP app: every route behind the API key but /health (and /metrics while ``server.public_metrics``)."""
    server = OpenAIServer(state)
    endpoint = server.endpoint
    public_metrics = state.config.server.public_metrics
    routes = [
        Route("/v1/completions", endpoint(server.completions, limited=True), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(server.chat_completions, limited=True), methods=["POST"]),
        Route("/v1/models", endpoint(server.models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", endpoint(server.model), methods=["GET"]),
        Route("/v1/load_lora_adapter", endpoint(server.load_lora_adapter), methods=["POST"]),
        Route("/v1/unload_lora_adapter", endpoint(server.unload_lora_adapter), methods=["POST"]),
        Route("/tokenize", endpoint(server.tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(server.detokenize), methods=["POST"]),
        Route("/openapi.json", endpoint(server.openapi), methods=["GET"]),
        Route("/health", endpoint(server.health, auth=False), methods=["GET"]),
        Route("/version", endpoint(server.version), methods=["GET"]),
        Route("/metrics", endpoint(server.metrics, auth=not public_metrics), methods=["GET"]),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        HTTPException: server.http_error,
        Exception: server.internal_error,
    }
    return Starlette(routes=routes, exception_handlers=handlers)
