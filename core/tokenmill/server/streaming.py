"""Server-sent events of a request in flight: completion and chat chunks, as OpenAI streams them.

The front end's ``OpenAIServer`` starts a ``Generation`` and hands its text deltas (the output processor's,
stop strings already held back) to ``completion_events`` or ``chat_events``, which turn them into the chunks of
the endpoint's stream. Imports no torch.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenmill.engine_client import RequestStream
from tokenmill.output_processor import CompletionDelta, OutputProcessor
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server import protocol
from tokenmill.server.parsing import ChoiceStream, OutputParsing
from tokenmill.server.protocol import ProtocolError
from tokenmill.server.tenants import Lease


@dataclass
class Generation:
    """One request in flight: its engine stream and the text built from it."""

    request_id: str
    stream: RequestStream
    processor: OutputProcessor
    output: RequestOutput
    params: SamplingParams
    arrival: float
    echo: bool = False  # completions: each text starts with the prompt
    last_token_at: dict[int, float] = field(default_factory=dict)  # by completion index
    first_token_at: float | None = None
    queue_time: float = 0.0  # in the engine, before its first step
    lease: Lease | None = None  # its key's: tokens are charged to it as they arrive
    model: str = ""  # what the request's ``model`` named: the base model or a LoRA adapter
    lora_name: str | None = None  # the LoRA adapter it runs with
    parsing: OutputParsing | None = None  # chat: reasoning and tool calls read out of the text


async def completion_events(
    generation: Generation,
    deltas: AsyncGenerator[CompletionDelta],
    created: int,
    include_usage: bool,
    num_top_logprobs: int | None,
    echo_prompt: Callable[[], protocol.Echo],
) -> AsyncIterator[bytes]:
    """A completion's SSE events: with ``echo``, each choice's prompt first (``echo_prompt``), then its text
    deltas, the usage chunk when asked, and ``[DONE]``; an error mid-stream is an error event."""
    model = generation.model
    echoed: set[int] = set()  # choices whose prompt went out
    echo_length = 0
    try:
        async with aclosing(deltas):
            async for delta in deltas:
                if generation.echo and delta.index not in echoed:  # each choice's first chunk: the prompt
                    echo = echo_prompt()
                    echoed.add(delta.index)
                    echo_length = len(echo.text)
                    logprobs = None
                    if echo.tokens is not None:
                        logprobs = protocol.completion_logprobs(echo.tokens, num_top_logprobs=num_top_logprobs)
                    chunk = protocol.completion_chunk(
                        generation.request_id, model, created, delta.index, echo.text, None, logprobs
                    )
                    yield protocol.sse_event(chunk)
                logprobs = None
                if delta.text_tokens is not None:
                    logprobs = protocol.completion_logprobs(
                        delta.text_tokens, text_offset=echo_length + delta.text_offset,
                        num_top_logprobs=num_top_logprobs,
                    )  # fmt: skip
                chunk = protocol.completion_chunk(
                    generation.request_id, model, created, delta.index, delta.text, delta.finish_reason, logprobs
                )
                yield protocol.sse_event(chunk)
        if include_usage:
            yield protocol.sse_event(_usage_chunk(generation, created, "text_completion"))
    except ProtocolError as exc:
        yield protocol.sse_event(protocol.error_dict(exc.status, exc.message, exc.type, exc.param, exc.code))
    yield protocol.SSE_DONE


async def chat_events(
    generation: Generation,
    deltas: AsyncGenerator[CompletionDelta],
    created: int,
    include_usage: bool,
    num_top_logprobs: int | None,
) -> AsyncIterator[bytes]:
    """A chat completion's SSE events: each choice's role, its content deltas (or, with parsers, its reasoning,
    content and tool-call deltas), the usage chunk when asked, and ``[DONE]``; an error mid-stream is an error
    event."""
    model = generation.model
    request_id = generation.request_id
    try:
        for index in range(generation.params.n):
            role = {"role": "assistant", "content": ""}
            yield protocol.sse_event(protocol.chat_chunk(request_id, model, created, index, role))
        parsing = generation.parsing
        streams = {index: parsing.stream() for index in range(generation.params.n)} if parsing else {}
        async with aclosing(deltas):
            async for delta in deltas:
                if parsing is not None:  # reasoning, content and tool-call argument deltas
                    for event in _parsed_chunks(generation, created, delta, streams[delta.index], num_top_logprobs):
                        yield event
                    continue
                if delta.text or delta.text_tokens:
                    logprobs = None
                    if delta.text_tokens is not None:
                        logprobs = protocol.chat_logprobs(delta.text_tokens, num_top_logprobs=num_top_logprobs)
                    content = {"content": delta.text}
                    chunk = protocol.chat_chunk(request_id, model, created, delta.index, content, None, logprobs)
                    yield protocol.sse_event(chunk)
                if delta.finish_reason is not None:
                    chunk = protocol.chat_chunk(request_id, model, created, delta.index, {}, delta.finish_reason)
                    yield protocol.sse_event(chunk)
        if include_usage:
            yield protocol.sse_event(_usage_chunk(generation, created, "chat.completion.chunk"))
    except ProtocolError as exc:
        yield protocol.sse_event(protocol.error_dict(exc.status, exc.message, exc.type, exc.param, exc.code))
    yield protocol.SSE_DONE


def _parsed_chunks(
    generation: Generation, created: int, delta: CompletionDelta, stream: ChoiceStream, num_top_logprobs: int | None
) -> list[bytes]:
    """The events of one text delta of a parsed choice: its parts (the first carries the delta's logprobs),
    and with its finish reason, what the parsers held back and the finish (``tool_calls`` when it called)."""
    model = generation.model
    parts = stream.feed(delta.text)
    if delta.finish_reason is not None:
        parts += stream.finish()
    logprobs = None
    if delta.text_tokens:
        logprobs = protocol.chat_logprobs(delta.text_tokens, num_top_logprobs=num_top_logprobs)
        parts = parts or [{"content": ""}]
    events = []
    for part in parts:
        chunk = protocol.chat_chunk(generation.request_id, model, created, delta.index, part, None, logprobs)
        events.append(protocol.sse_event(chunk))
        logprobs = None
    if delta.finish_reason is not None:
        reason = "tool_calls" if delta.finish_reason == "stop" and stream.called_tools else delta.finish_reason
        chunk = protocol.chat_chunk(generation.request_id, model, created, delta.index, {}, reason)
        events.append(protocol.sse_event(chunk))
    return events


def _usage_chunk(
    generation: Generation, created: int, kind: Literal["text_completion", "chat.completion.chunk"]
) -> dict[str, Any]:
    prompt_tokens = len(generation.output.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in generation.output.outputs)
    return protocol.usage_chunk(
        generation.request_id, generation.model, created, kind, prompt_tokens, completion_tokens
    )
