"""The OpenAI wire format: request decoding and checks, SamplingParams mapping, and response shapes.

Response dicts are validated by the ``openai`` client's own pydantic models,
an implementation nobody here wrote, so a wrong field name or type fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Literal

import msgspec
import pytest
from openai.types import Completion, CompletionChoice, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject

from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput, TextToken
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    TokenizeChatRequest,
    chat_chunk,
    chat_logprobs,
    chat_messages,
    chat_response,
    check_context_length,
    completion_chunk,
    completion_logprobs,
    completion_prompt,
    completion_response,
    decode_chat_request,
    decode_completion_request,
    decode_tokenize_request,
    error_body,
    error_dict,
    model_not_found,
    models_response,
    sse_event,
    usage_chunk,
)

USER = [{"role": "user", "content": "hi"}]


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def completion(**fields: Any) -> CompletionRequest:
    return decode_completion_request(body(model="m", prompt="hello", **fields))[0]


def chat(**fields: Any) -> ChatCompletionRequest:
    return decode_chat_request(body(model="m", messages=fields.pop("messages", USER), **fields))[0]


def completion_params(**fields: Any) -> SamplingParams:
    return decode_completion_request(body(model="m", prompt="hello", **fields))[1]


def chat_params(**fields: Any) -> SamplingParams:
    return decode_chat_request(body(model="m", messages=fields.pop("messages", USER), **fields))[1]


# ---------------------------------------------------------------- decoding valid bodies


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hello", "hello"), (["hello"], "hello"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5]), ("", "")],
    ids=["str", "list-of-one-str", "token-ids", "list-of-one-token-list", "empty-str"],
)
def test_every_prompt_shape_decodes_to_one_prompt(prompt: Any, expected: str | list[int]) -> None:
    request, _ = decode_completion_request(body(model="m", prompt=prompt))
    assert request.prompt == expected  # the decoder stores the one prompt back
    assert completion_prompt(request) == expected  # and normalizing again changes nothing


def test_completion_defaults_and_extensions() -> None:
    request = completion()
    defaults = (request.max_tokens, request.temperature, request.n, request.stream, request.priority)
    assert defaults == (16, 1.0, 1, False, 0)
    extended = completion(
        top_k=5, min_p=0.1, repetition_penalty=1.2, ignore_eos=True, min_tokens=2, stop_token_ids=[7],
        skip_special_tokens=False, priority=3, user="u", best_of=1, logit_bias={}, seed=9,
        stream=True, stream_options={"include_usage": True}, stop="###", logprobs=5,
    )  # fmt: skip
    assert extended.priority == 3 and extended.stream_options is not None and extended.stream_options.include_usage


def test_null_optional_fields_take_the_defaults() -> None:
    params = completion_params(temperature=None, top_p=None, n=None, stop=None, top_k=None, stream=None)
    assert (params.temperature, params.top_p, params.n, params.stop, params.top_k) == (1.0, 1.0, 1, [], 0)


def test_chat_messages_are_plain_text_for_the_template() -> None:
    request = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"},
            {"role": "assistant", "content": None, "refusal": None},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ]
    )
    assert chat_messages(request.messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]


def test_chat_template_kwargs_are_kept_for_the_template() -> None:
    kwargs = {"enable_thinking": False, "persona": {"name": "x", "traits": [1, 2.5, None]}, "bos_token": ""}
    assert chat(chat_template_kwargs=kwargs).chat_template_kwargs == kwargs
    assert chat().chat_template_kwargs is None
    request = decode_tokenize_request(body(messages=USER, chat_template_kwargs={"enable_thinking": True}))
    assert isinstance(request, TokenizeChatRequest) and request.chat_template_kwargs == {"enable_thinking": True}


# ---------------------------------------------------------------- invalid bodies

C, CHAT, TOKENIZE = decode_completion_request, decode_chat_request, decode_tokenize_request
MSG = {"model": "m", "messages": USER}
PROMPT = {"model": "m", "prompt": "x"}

INVALID = [
    # (decoder, body, message, param)
    (C, b"{not json", "request body is not valid JSON: JSON is malformed: object keys must be strings (byte 1)", None),
    (C, b"[]", "request body must be a JSON object: Expected `object`, got `array`", None),
    (C, body(prompt="x"), "missing required parameter: 'model'", "model"),
    (C, body(**PROMPT, foo=1), "unrecognized request argument supplied: foo", "foo"),
    (CHAT, body(model="m", messages=[{"role": "user", "content": "x", "foo": 1}]),
     "unrecognized request argument supplied: messages[0].foo", "messages[0].foo"),
    (C, body(**PROMPT, temperature="hot"), "invalid value for 'temperature': expected a number, got `str`",
     "temperature"),
    (CHAT, body(model="m", messages=[{"role": "bot", "content": "x"}]),
     "invalid value for 'messages[0].role': Invalid enum value 'bot'", "messages[0].role"),
    (C, body(**PROMPT, temperature=-0.5), "invalid value for 'temperature': expected a number >= 0.0", "temperature"),
    (C, body(**PROMPT, top_p=0), "invalid value for 'top_p': expected a number > 0.0", "top_p"),
    (CHAT, body(**MSG, top_p=1.5), "invalid value for 'top_p': expected a number <= 1.0", "top_p"),
    (C, body(**PROMPT, n=0), "invalid value for 'n': expected an integer >= 1", "n"),
    (C, body(**PROMPT, n=129), "invalid value for 'n': expected an integer <= 128", "n"),
    (C, body(**PROMPT, logprobs=6), "invalid value for 'logprobs': expected an integer <= 5", "logprobs"),
    (C, body(**PROMPT, logprobs=-1), "invalid value for 'logprobs': expected an integer >= 0", "logprobs"),
    (CHAT, body(**MSG, logprobs=True, top_logprobs=21), "invalid value for 'top_logprobs': expected an integer <= 20",
     "top_logprobs"),
    (CHAT, body(**MSG, top_logprobs=2), "top_logprobs requires logprobs to be true", "top_logprobs"),
    (C, body(**PROMPT, max_tokens=0), "invalid value for 'max_tokens': expected an integer >= 1", "max_tokens"),
    (CHAT, body(**MSG, max_tokens=5, max_completion_tokens=0),
     "invalid value for 'max_completion_tokens': expected an integer >= 1", "max_completion_tokens"),
    (C, body(**PROMPT, min_tokens=17), "min_tokens=17 is invalid: must not exceed max_tokens=16", "min_tokens"),
    (C, body(**PROMPT, stream_options={"include_usage": True}),
     "stream_options is only allowed when stream is true", "stream_options"),
    (CHAT, body(**MSG, stream=False, stream_options={"include_usage": True}),
     "stream_options is only allowed when stream is true", "stream_options"),
    (C, body(**PROMPT, stop=[f"s{i}" for i in range(17)]),
     "invalid value for 'stop': expected an array of length <= 16", "stop"),
    (C, body(**PROMPT, stop=""), "invalid value for 'stop': expected a string of length >= 1", "stop"),
    (C, body(**PROMPT, suffix="!"), "suffix is not supported", "suffix"),
    (C, body(**PROMPT, best_of=3), "best_of is not supported: leave it out or set it equal to n", "best_of"),
    (C, body(**PROMPT, logit_bias={"x": -100}), 'logit_bias keys must be token ids, such as {"50256": -100}',
     "logit_bias"),
    (C, body(**PROMPT, logit_bias={"5": -101}),
     "invalid value for 'logit_bias': expected a number >= -100.0", "logit_bias"),
    (C, body(model="m", prompt=["a", "b"]), "only one prompt per request is supported", "prompt"),
    (C, body(model="m", prompt=[[1], [2]]), "only one prompt per request is supported", "prompt"),
    (C, body(model="m", prompt=[]), "prompt must be a string, a list of token ids, or a list holding one of either",
     "prompt"),
    (C, body(model="m", prompt=[1, "a"]),
     "prompt must be a string, a list of token ids, or a list holding one of either", "prompt"),
    (C, body(model="m", prompt=[[]]), "a token id prompt must be a non-empty list of ids >= 0", "prompt"),
    (C, body(model="m", prompt=[3, -1]), "a token id prompt must be a non-empty list of ids >= 0", "prompt"),
    (CHAT, body(**MSG, response_format={"type": "xml"}),
     "invalid value for 'response_format.type': Invalid enum value 'xml'", "response_format.type"),
    (CHAT, body(**MSG, tools=[{"type": "function"}]), "missing required parameter: 'tools[0].function'",
     "tools[0].function"),
    (CHAT, body(**MSG, tool_choice="auto"), "tool_choice is only allowed when tools are given", "tool_choice"),
    (CHAT, body(**MSG, tools=[{"type": "function", "function": {"name": "f"}}]),
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set; use "required" or a '
     "named function, which need neither", "tool_choice"),
    (C, body(**PROMPT, response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
     "give either response_format or structured_outputs, not both", "response_format"),
    (CHAT, body(model="m", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]),
     "only text content is supported (messages[0].content[0] has type 'image_url')", "messages[0].content[0]"),
    (CHAT, body(model="m", messages=[]), "invalid value for 'messages': expected an array of length >= 1", "messages"),
    # What once crashed the server or slipped through: ints too wide for the engine's wire format, bytes
    # that are not UTF-8, nesting that exhausts the decoder's recursion, a user message with no content.
    (C, body(**PROMPT, seed=2**70), "invalid value for 'seed': expected an integer <= 9223372036854775807", "seed"),
    (C, body(**PROMPT, priority=-(2**70)), "invalid value for 'priority': expected an integer >= -9223372036854775808",
     "priority"),
    (C, body(**PROMPT, top_k=2**40), "invalid value for 'top_k': expected an integer <= 2147483647", "top_k"),
    (C, body(**PROMPT, stop_token_ids=[-1]), "invalid value for 'stop_token_ids[0]': expected an integer >= 0",
     "stop_token_ids[0]"),
    (C, body(**PROMPT, stop="x" * 1025), "invalid value for 'stop': expected a string of length <= 1024", "stop"),
    (C, body(**PROMPT, vllm_xargs={"a": [1, {"b": 2**70}]}),
     "vllm_xargs holds the integer 1180591620717411303424, outside the 64-bit range", "vllm_xargs"),
    (C, b'{"model": "m", "prompt": "x", "vllm_xargs": {"a": ' + b"[" * 40 + b"]" * 40 + b"}}",
     "vllm_xargs is nested more than 32 levels deep", "vllm_xargs"),
    (C, b'{"model": "m", "prompt": "x", "vllm_xargs": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
     "request body is nested more than 32 levels deep", None),
    (C, b'{"model": "\xff", "prompt": "x"}', "request body is not valid UTF-8 (invalid start byte)", None),
    (CHAT, body(model="m", messages=[{"role": "user"}]),
     "missing required parameter: 'messages[0].content' (a user message needs content)", "messages[0].content"),
    (CHAT, body(**MSG, chat_template_kwargs=["enable_thinking"]),
     "invalid value for 'chat_template_kwargs': expected an object, got `array`", "chat_template_kwargs"),
    (CHAT, body(**MSG, chat_template_kwargs={"enable_thinking": False, "messages": []}),
     "chat_template_kwargs cannot set 'messages': messages, tools, documents and add_generation_prompt come from "
     "the request itself, and chat_template and tokenize are not template variables", "chat_template_kwargs"),
    (TOKENIZE, body(messages=USER, chat_template_kwargs={"tokenize": True}),
     "chat_template_kwargs cannot set 'tokenize': messages, tools, documents and add_generation_prompt come from "
     "the request itself, and chat_template and tokenize are not template variables", "chat_template_kwargs"),
    (CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
     + b"[" * 40 + b"]" * 40 + b"}}", "chat_template_kwargs is nested more than 32 levels deep",
     "chat_template_kwargs"),
]  # fmt: skip


@pytest.mark.parametrize(("decode", "raw", "message", "param"), INVALID, ids=[str(i) for i in range(len(INVALID))])
def test_invalid_request_is_a_400_naming_the_parameter(
    decode: Any, raw: bytes, message: str, param: str | None
) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode(raw)
    error = caught.value
    assert (error.status, error.message, error.param, error.type) == (400, message, param, "invalid_request_error")
    assert "\n" not in error.message


# ---------------------------------------------------------------- SamplingParams mapping


def test_extensions_and_openai_fields_pass_through() -> None:
    request = completion(
        temperature=0.5, top_p=0.9, n=2, presence_penalty=0.3, frequency_penalty=-0.2, seed=11, stop="END",
        logprobs=3, top_k=40, min_p=0.05, repetition_penalty=1.1, ignore_eos=True, min_tokens=2,
        stop_token_ids=[9], skip_special_tokens=False, max_tokens=20,
    )  # fmt: skip
    params = decode_completion_request(msgspec.json.encode(request))[1]
    assert params == msgspec.convert(
        {
            "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
            "presence_penalty": 0.3, "frequency_penalty": -0.2, "seed": 11, "max_tokens": 20, "min_tokens": 2,
            "stop": ["END"], "stop_token_ids": [9], "ignore_eos": True, "logprobs": 3, "skip_special_tokens": False,
        },
        type(params),
    )  # fmt: skip


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat_params(max_tokens=5, max_completion_tokens=7).max_tokens == 7
    assert chat_params(max_tokens=5).max_tokens == 5


def test_missing_max_tokens_means_the_rest_of_the_context() -> None:
    # None: the engine stops the request at the context window.
    assert chat_params().max_tokens is None and completion_params(max_tokens=None).max_tokens is None
    check_context_length(completion(max_tokens=None), completion_params(max_tokens=None), 99, 100)
    check_context_length(completion(), completion_params(), prompt_len=84, max_model_len=100)  # exactly fits


def test_logit_bias_and_vllm_xargs_reach_the_sampling_params() -> None:
    params = completion_params(logit_bias={"5": -100, "17": 2.5}, vllm_xargs={"banned": [3]})
    assert params.logit_bias == {5: -100.0, 17: 2.5} and params.extra_args == {"banned": [3]}


@pytest.mark.parametrize(
    ("fields", "expected"), [({}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 4}, 4)]
)
def test_chat_logprobs_map_to_the_number_of_alternatives(fields: dict[str, Any], expected: int | None) -> None:
    assert chat_params(**fields).logprobs == expected


def test_context_length_exceeded_uses_openais_wording() -> None:
    with pytest.raises(ProtocolError) as caught:
        check_context_length(chat(max_tokens=50), chat_params(max_tokens=50), prompt_len=60, max_model_len=100)
    error = caught.value
    assert (error.status, error.param, error.code) == (400, "messages", "context_length_exceeded")
    assert error.message == (
        "This model's maximum context length is 100 tokens. However, you requested 110 tokens "
        "(60 in the messages, 50 for the completion). Please reduce the length of the messages or completion."
    )
    with pytest.raises(ProtocolError) as caught:
        check_context_length(completion(max_tokens=17), completion_params(max_tokens=17), 84, 100)
    assert caught.value.param == "max_tokens" and "(84 in the prompt, 17 for the completion)" in caught.value.message


def test_prompt_that_fills_the_context_is_rejected() -> None:
    with pytest.raises(ProtocolError) as caught:
        check_context_length(chat(), chat_params(), prompt_len=100, max_model_len=100)
    assert caught.value.message == (
        "This model's maximum context length is 100 tokens. However, your messages resulted in 100 tokens. "
        "Please reduce the length of the messages."
    )
    assert caught.value.code == "context_length_exceeded"


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("status", "type_", "code"),
    [
        (400, "invalid_request_error", None),
        (401, "invalid_request_error", "invalid_api_key"),
        (404, "invalid_request_error", "model_not_found"),
        (429, "rate_limit_error", "rate_limit_exceeded"),
        (500, "server_error", None),
        (503, "server_error", None),
    ],
)
def test_error_body_defaults_follow_openai(status: int, type_: str, code: str | None) -> None:
    decoded = json.loads(error_body(status, "boom"))
    assert decoded == {"error": {"message": "boom", "type": type_, "param": None, "code": code}}
    assert ErrorObject.model_validate(decoded["error"]).type == type_


def test_error_dict_is_the_stream_error_event() -> None:
    event = sse_event(error_dict(503, "engine down", code="engine_unavailable"))
    decoded = json.loads(event.removeprefix(b"data: "))
    assert decoded == {
        "error": {"message": "engine down", "type": "server_error", "param": None, "code": "engine_unavailable"}
    }


def test_protocol_error_body_carries_param_and_code() -> None:
    error = model_not_found("gpt-x")
    assert error.status == 404
    assert json.loads(error.body())["error"] == {
        "message": "The model `gpt-x` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


# ---------------------------------------------------------------- responses


def lp(value: float, text: str) -> Logprob:
    return Logprob(value, text)


def finished_output(n: int = 1, with_logprobs: bool = True) -> RequestOutput:
    # Token 5 " a" sampled (also top-1), then token 9 "é" sampled outside the top-2.
    logprobs = [
        {5: lp(-0.1, " a"), 6: lp(-2.5, " b")},
        {9: lp(float("-inf"), "é"), 5: lp(-0.2, " a"), 6: lp(-1.9, " b")},
    ]
    text_tokens = [TextToken(5, " a", logprobs[0]), TextToken(9, "é", logprobs[1])]
    outputs = [
        CompletionOutput(
            index=i,
            text=" aé",
            token_ids=[5, 9],
            finish_reason="length",
            logprobs=logprobs if with_logprobs else None,
            text_tokens=text_tokens if with_logprobs else None,
        )
        for i in reversed(range(n))  # out of order on purpose
    ]
    return RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1, 2, 3], outputs=outputs, finished=True)


def test_completion_response_parses_as_openai_completion() -> None:
    response = completion_response("cmpl-1", "m", 1700, finished_output(n=2), prompt_tokens=3, num_top_logprobs=2)
    parsed = Completion.model_validate(json.loads(msgspec.json.encode(response)))
    assert [c.index for c in parsed.choices] == [0, 1]
    assert parsed.usage is not None and (parsed.usage.completion_tokens, parsed.usage.total_tokens) == (4, 7)
    logprobs = parsed.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == [" a", "é"] and logprobs.text_offset == [0, 2]
    assert logprobs.token_logprobs == [-0.1, -9999.0]  # -inf clamped: JSON has no infinity
    assert logprobs.top_logprobs == [{" a": -0.1, " b": -2.5}, {" a": -0.2, " b": -1.9}]


def test_completion_response_without_logprobs_and_running_offsets() -> None:
    response = completion_response("cmpl-1", "m", 1, finished_output(with_logprobs=False), 3)
    assert Completion.model_validate(response).choices[0].logprobs is None
    entries = {5: lp(-0.1, " a"), 6: lp(-2.5, " b")}
    decoded = completion_logprobs([TextToken(5, " a", entries)], text_offset=7)
    # Token texts are the ones the output processor decoded, never decoded again here.
    assert decoded == {"tokens": [" a"], "token_logprobs": [-0.1], "top_logprobs": [{" a": -0.1, " b": -2.5}],
                       "text_offset": [7]}  # fmt: skip


def test_chat_response_parses_as_openai_chat_completion() -> None:
    response = chat_response("chatcmpl-1", "m", 1700, finished_output(), prompt_tokens=3, num_top_logprobs=1)
    parsed = ChatCompletion.model_validate(json.loads(msgspec.json.encode(response)))
    choice = parsed.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == " aé"
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    second = choice.logprobs.content[1]
    assert (second.token, second.logprob, second.bytes) == ("é", -9999.0, [0xC3, 0xA9])
    assert [(t.token, t.logprob) for t in second.top_logprobs] == [(" a", -0.2)]


def test_chat_logprobs_with_zero_alternatives_lists_none() -> None:
    content = chat_logprobs([TextToken(5, " a", {5: lp(-0.1, " a"), 6: lp(-2.5, " b")})], num_top_logprobs=0)["content"]
    assert content == [{"token": " a", "logprob": -0.1, "bytes": [32, 97], "top_logprobs": []}]


def test_aborted_requests_never_get_a_finish_reason() -> None:
    output = finished_output()
    output.outputs[0].finish_reason = "abort"
    with pytest.raises(ProtocolError) as caught:
        chat_response("chatcmpl-1", "m", 1, output, 3)
    assert caught.value.status == 503 and caught.value.type == "server_error"
    with pytest.raises(ProtocolError):
        chat_chunk("chatcmpl-1", "m", 1, 0, {}, finish_reason="abort")


class _StreamedChoice(CompletionChoice):
    # The openai client's type says finish_reason is always set, but OpenAI streams null until the last
    # chunk (the client parses stream chunks without validation); only that one field is relaxed here.
    finish_reason: Literal["stop", "length", "content_filter"] | None  # type: ignore[assignment]


class _StreamedCompletion(Completion):
    choices: list[_StreamedChoice]  # type: ignore[assignment]


def test_completion_stream_chunks_parse() -> None:
    logprobs = completion_logprobs([TextToken(5, " a", {5: lp(-0.1, " a")})], text_offset=4)
    middle = _StreamedCompletion.model_validate(completion_chunk("cmpl-1", "m", 1, 1, " a", logprobs=logprobs))
    assert middle.choices[0].finish_reason is None and middle.choices[0].index == 1
    assert middle.choices[0].logprobs is not None and middle.choices[0].logprobs.text_offset == [4]
    last = Completion.model_validate(completion_chunk("cmpl-1", "m", 1, 0, "", finish_reason="stop"))
    assert last.choices[0].finish_reason == "stop"
    usage = Completion.model_validate(usage_chunk("cmpl-1", "m", 1, "text_completion", 3, 5))
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 8


def test_chat_stream_chunks_parse() -> None:
    first = ChatCompletionChunk.model_validate(chat_chunk("c", "m", 1, 0, {"role": "assistant", "content": ""}))
    assert first.choices[0].delta.role == "assistant" and first.choices[0].finish_reason is None
    logprobs = chat_logprobs([TextToken(5, " a", {5: lp(-0.1, " a"), 6: lp(-2.5, " b")})], num_top_logprobs=1)
    piece = ChatCompletionChunk.model_validate(chat_chunk("c", "m", 1, 0, {"content": " a"}, logprobs=logprobs))
    assert piece.choices[0].delta.content == " a"
    assert piece.choices[0].logprobs is not None and piece.choices[0].logprobs.content is not None
    last = ChatCompletionChunk.model_validate(chat_chunk("c", "m", 1, 0, {}, finish_reason="length"))
    assert last.choices[0].finish_reason == "length" and last.choices[0].delta.content is None
    usage = ChatCompletionChunk.model_validate(usage_chunk("c", "m", 1, "chat.completion.chunk", 3, 5))
    assert usage.object == "chat.completion.chunk" and usage.choices == [] and usage.usage is not None


def test_sse_event_framing() -> None:
    event = sse_event({"text": "a\nb"})  # the newline is escaped inside the JSON string
    assert event == b'data: {"text":"a\\nb"}\n\n'
    assert json.loads(event.removeprefix(b"data: ")) == {"text": "a\nb"}
    assert sse_event("[DONE]") == SSE_DONE == b"data: [DONE]\n\n"


def test_models_response_lists_openai_models() -> None:
    response = models_response(["a", "b"], created=1700)
    assert response["object"] == "list"
    models = [Model.model_validate(entry) for entry in response["data"]]
    assert [(m.id, m.owned_by, m.created) for m in models] == [("a", "tokenmill", 1700), ("b", "tokenmill", 1700)]


def test_protocol_module_does_not_import_torch() -> None:
    code = "import sys, tokenmill.server.protocol; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
