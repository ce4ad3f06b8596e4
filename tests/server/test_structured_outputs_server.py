"""Structured outputs and forced tool calls through a real `tokenmill serve` (a tiny random model at temperature
1.0, which writes bytes at random unless masked), driven by the official openai client: ``parse()`` with a
pydantic model, ``json_schema`` strict, vLLM's ``structured_outputs`` on both endpoints, ``tools`` with
``tool_choice`` required and named (whole and streamed), and a constraint that cannot compile is a 400 while the
server keeps serving; the same constraints sent at once to a server with two engine replicas come back valid from
both. Every JSON output is checked with ``jsonschema``."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.server.conftest import Server, start_server
from tests.structured_output.schemas import SCHEMAS, assert_valid
from tokenmill.testing import save_tiny_model

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

# Compact JSON: a random model would otherwise pad it with whitespace until max_tokens.
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
MESSAGES: Any = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = save_tiny_model(tmp_path_factory.mktemp("structured") / "llama")
    server = start_server(
        tmp_path_factory.mktemp("structured-server"), str(model_dir), "--served-model-name", "tiny",
        "--structured-outputs-config", '{"disable_any_whitespace": true}', model_name="tiny",
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


class Point(pydantic.BaseModel):
    x: int = pydantic.Field(ge=-9, le=9)
    label: Literal["a", "bb", "ccc"]
    ok: bool


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(
            model="tiny", messages=MESSAGES, response_format=Point, temperature=1.0, seed=seed, max_tokens=60
        )
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Point), completion.choices[0].message.content


def test_json_schema_strict_and_json_object(client: openai.OpenAI) -> None:
    schema = SCHEMAS["enum_and_array"]
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=response_format, temperature=1.0, seed=1, max_tokens=80, n=4
    )
    assert len(completion.choices) == 4
    for choice in completion.choices:
        assert choice.message.content is not None
        assert_valid(choice.message.content, schema)
    any_object = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format={"type": "json_object"}, temperature=0, max_tokens=100
    )
    if any_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(any_object.choices[0].message.content or ""), dict)


def test_structured_outputs_field_on_both_endpoints(client: openai.OpenAI) -> None:
    regex = r"[a-c]{2,4}-\d"
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=1.0, seed=3, max_tokens=20,
        extra_body={"structured_outputs": {"regex": regex}},
    )  # fmt: skip
    assert re.fullmatch(regex, chat.choices[0].message.content or "")
    completion = client.completions.create(
        model="tiny", prompt="pick:", temperature=1.0, seed=4, max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )  # fmt: skip
    assert completion.choices[0].text in ("left", "right")
    schema = SCHEMAS["nested"]
    streamed = client.completions.create(
        model="tiny", prompt="x", temperature=1.0, seed=5, max_tokens=80, stream=True,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
    )  # fmt: skip
    assert_valid("".join(chunk.choices[0].text for chunk in streamed if chunk.choices), schema)


WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 3}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}


def _assert_valid_tool_calls(choice: Any) -> None:
    """A forced tool call's choice ended by its calls, each one's arguments valid against its function's parameters."""
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message.content
    for call in choice.message.tool_calls:
        assert call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_required_and_named_tool_calls_match_their_parameters(client: openai.OpenAI) -> None:
    for seed in range(4):
        completion = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
            max_tokens=600,  # parallel calls: each ends the array or adds a call, about evenly at random
        )  # fmt: skip
        _assert_valid_tool_calls(completion.choices[0])
    named = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=9, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    calls = named.choices[0].message.tool_calls
    assert calls and [c.function.name for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0].function.arguments), TIME)
    single = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=1.0, seed=2, max_tokens=120,
    )  # fmt: skip
    assert len(single.choices[0].message.tool_calls or []) == 1


def test_streamed_tool_call_deltas_reassemble_into_valid_arguments(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, seed=7,
        max_tokens=600, stream=True,
    )  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function and delta.function.name:
                    call["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    assert finish == "tool_calls" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"extra_body": {"structured_outputs": {"json": {"type": "strin"}}}}, "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}},
         "response_format"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS}, "tool_choice"),  # "auto" needs --enable-auto-tool-choice
    ],
)  # fmt: skip
def test_a_constraint_that_cannot_be_used_is_a_400_and_the_server_keeps_serving(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, **kwargs)
    error = raised.value.body
    assert isinstance(error, dict) and error.get("param") == param, error
    ok = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=20, extra_body={"structured_outputs": {"choice": ["y", "n"]}}
    )
    assert ok.choices[0].message.content in ("y", "n")


def test_data_parallel_engines_each_serve_valid_structured_outputs(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every engine replica compiles and applies constraints of its own: json_schema strict and tool_choice
    required requests sent at once to two engines (round-robin) all come back valid, and both engines ran some."""
    model_dir = save_tiny_model(tmp_path_factory.mktemp("structured-dp") / "llama")
    server = start_server(
        tmp_path_factory.mktemp("structured-dp-server"), str(model_dir), "--served-model-name", "tiny",
        "--data-parallel-size", "2", "--structured-outputs-config", '{"disable_any_whitespace": true}',
        model_name="tiny",
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)

    def schema_reply(name: str, seed: int) -> None:
        schema = SCHEMAS[name]
        response_format: Any = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        completion = client.chat.completions.create(
            model="tiny", messages=MESSAGES, response_format=response_format, temperature=1.0, seed=seed,
            max_tokens=120,
        )  # fmt: skip
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert_valid(choice.message.content or "", schema)

    def tool_reply(seed: int) -> None:
        completion = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            temperature=1.0, seed=seed, max_tokens=120,
        )  # fmt: skip
        _assert_valid_tool_calls(completion.choices[0])

    try:
        jobs: list[Callable[[], None]] = [
            functools.partial(schema_reply, name, seed) for name in SCHEMAS for seed in range(2)
        ]
        jobs += [functools.partial(tool_reply, seed) for seed in range(2)]
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            for future in [pool.submit(job) for job in jobs]:
                future.result()  # re-raises a reply's failed check
        ended = re.findall(r'^tokenmill:request_success_total\{[^}]*engine="(\d+)"[^}]*\} (\S+)$',
                           httpx.get(f"{server.url}/metrics").text, flags=re.MULTILINE)  # fmt: skip
        by_engine: dict[str, float] = {}
        for engine, value in ended:
            by_engine[engine] = by_engine.get(engine, 0.0) + float(value)
        assert sum(by_engine.values()) == len(jobs)
        assert set(by_engine) == {"0", "1"} and all(count > 0 for count in by_engine.values()), by_engine
    finally:
        client.close()
        assert server.stop() == 0
