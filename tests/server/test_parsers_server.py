"""Tool-call and reasoning parsers through a real `tokenmill serve --enable-auto-tool-choice --tool-call-parser
hermes --reasoning-parser qwen3`, driven by the official openai client: ``tool_choice`` auto returns the calls the
model wrote in Qwen's format as ``tool_calls``, ``<think>`` goes to ``reasoning_content``, streamed deltas join
into the whole response, and the chat template sees the tools.

The tiny random model writes what a ``structured_outputs`` regex forces, which makes the outputs deterministic.
With the reasoning parser the grammar starts after ``</think>``: ``logit_bias`` makes ``</think>`` the first
token (the grammar then masks it away), so the thinking is empty here; tests/parsers/test_reasoning_engine.py
thinks longer."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.parsers.models import save_qwen_like_model
from tests.server.conftest import Server, start_server

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

MESSAGES: Any = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", "days": [1-7]\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = save_qwen_like_model(tmp_path_factory.mktemp("parsers") / "qwen-like")
    server = start_server(
        tmp_path_factory.mktemp("parsers-server"), str(model_dir), "--served-model-name", "tiny",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
        model_name="tiny",
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _create(client: openai.OpenAI, regex: str, seed: int, **kwargs: Any) -> Any:
    """A chat completion that thinks nothing (``</think>`` first), then writes what ``regex`` allows."""
    end_of_thinking = "511"  # tests.parsers.models: the markers are the last ids, "</think>" the very last
    return client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=120,
        logit_bias={end_of_thinking: 100}, extra_body={"structured_outputs": {"regex": regex}}, **kwargs,
    )  # fmt: skip


def _joined(stream: Any) -> tuple[dict[str, str], list[dict[str, str]], str | None]:
    """A stream's reasoning and content joined, its calls reassembled, its finish reason."""
    texts = {"reasoning_content": "", "content": ""}
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            delta = choice.delta
            texts["content"] += delta.content or ""
            texts["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                if call.function and call.function.name:
                    entry["name"] = call.function.name
                if call.function and call.function.arguments:
                    entry["arguments"] += call.function.arguments
    return texts, [calls[i] for i in sorted(calls)], finish


def test_auto_tool_choice_returns_the_parsed_calls(client: openai.OpenAI) -> None:
    for seed in range(2):
        completion = _create(client, CALL, seed, tools=TOOLS)  # tool_choice: "auto", the default
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        calls = choice.message.tool_calls
        assert calls and [c.function.name for c in calls] == ["get_weather"] and calls[0].id.startswith("call_")
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
        assert choice.message.model_extra.get("reasoning_content") == ""
        assert choice.message.content is None
        streamed, streamed_calls, finish = _joined(_create(client, CALL, seed, tools=TOOLS, stream=True))
        assert finish == "tool_calls"
        assert streamed == {"reasoning_content": "", "content": ""}
        assert streamed_calls == [{"name": "get_weather", "arguments": calls[0].function.arguments}]


def test_reasoning_content_is_split_from_the_answer(client: openai.OpenAI) -> None:
    completion = _create(client, "[a-z]{2,6}", seed=4)
    message = completion.choices[0].message
    reasoning = message.model_extra.get("reasoning_content")
    assert completion.choices[0].finish_reason == "stop" and message.tool_calls is None
    assert reasoning == "" and message.content and message.content.isalpha()
    streamed, calls, finish = _joined(_create(client, "[a-z]{2,6}", seed=4, stream=True))
    assert (streamed, calls, finish) == ({"reasoning_content": reasoning, "content": message.content}, [], "stop")


def test_enable_thinking_false_closes_the_thinking_in_the_prompt(client: openai.OpenAI, server: Server) -> None:
    # Qwen3's switch, through vLLM's chat_template_kwargs: the template writes "<think>\n\n</think>\n\n" into
    # the prompt, so the whole output is content and the grammar masks from the first token (no logit_bias here:
    # the thinking is already over).
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    for stream in (False, True):
        completion = client.chat.completions.create(
            model="tiny", messages=MESSAGES, temperature=1.0, seed=5, max_tokens=20, stream=stream,
            extra_body={"structured_outputs": {"regex": "[a-z]{2,6}"}, **off},
        )  # fmt: skip
        if stream:
            texts, calls, finish = _joined(completion)
            assert texts["reasoning_content"] == "" and not calls and finish == "stop"
            assert re.fullmatch("[a-z]{2,6}", texts["content"]), texts
        else:
            message = completion.choices[0].message
            assert message.model_extra.get("reasoning_content") is None
            assert re.fullmatch("[a-z]{2,6}", message.content or ""), message
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    usages = [
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, extra_body=body).usage
        for body in (on, off)
    ]
    block = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "<think>\n\n</think>\n\n", "add_special_tokens": False}
    )
    assert usages[0] and usages[1]
    assert usages[1].prompt_tokens == usages[0].prompt_tokens + block.json()["count"]


def test_text_without_calls_stays_content_and_the_template_sees_the_tools(client: openai.OpenAI) -> None:
    with_tools = _create(client, "no call", seed=1, tools=TOOLS)
    assert with_tools.choices[0].message.content == "no call" and not with_tools.choices[0].message.tool_calls
    without = _create(client, "no call", seed=1)
    assert with_tools.usage and without.usage
    # The tools' JSON and the call format are in the prompt: Qwen's template renders them in a system turn.
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + len(json.dumps(TOOLS)) // 2
