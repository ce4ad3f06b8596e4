"""The OpenAI-compatible wire format: request schemas, their mapping to SamplingParams, response builders.

Pure functions and msgspec structs, with no I/O and no web framework, so the
HTTP layer stays thin and all of this is tested without a server. Never
imports torch: the API front end starts without it.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, cast

import msgspec

from tokenmill.outputs import Logprob, RequestOutput, TextToken
from tokenmill.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams
from tokenmill.server.tools import ChatTool, ForcedToolCall, ResponseFormat, ToolChoice, ToolError, request_constraint
from tokenmill.tokenizer.chat_template import check_template_kwargs

logger = logging.getLogger(__name__)

MAX_N = 128  # OpenAI's limit; each choice is a sequence in the batch
MAX_STOP_SEQUENCES = 16  # OpenAI allows 4; more is cheap for us
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions `logprobs`, as OpenAI
MAX_TOP_LOGPROBS = 20  # /v1/chat/completions `top_logprobs`, as OpenAI
MAX_STOP_LENGTH = 1024  # characters per stop string: each is searched for in every new piece of text
MAX_CACHE_SALT_LENGTH = 1024  # characters; hashed into the first block's hash, never stored per block
MAX_JSON_DEPTH = 32  # nesting of free-form fields (vllm_xargs, tool_calls); typed fields nest a fixed few levels
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the range vLLM takes for seed; wider ints cannot reach the engine
UINT64_MAX = 2**64 - 1
_MIN_LOGPROB = -9999.0  # JSON has no -inf, and clients expect a number (vLLM does the same)

# status -> (type, code) when the caller gives none; OpenAI reports 401 and 404 as invalid requests.
_ERROR_DEFAULTS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
}

_T = TypeVar("_T")


# ---------------------------------------------------------------- errors


def _error_defaults(status: int) -> tuple[str, str | None]:
    return _ERROR_DEFAULTS.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))


def error_dict(
    status: int, message: str, type: str | None = None, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``; a stream sends it as an event."""
    default_type, default_code = _error_defaults(status)
    return {"error": {"message": message, "type": type or default_type, "param": param, "code": code or default_code}}


def error_body(
    status: int, message: str, type: str | None = None, param: str | None = None, code: str | None = None
) -> bytes:
    """error_dict() as the JSON body of an HTTP error response."""
    return msgspec.json.encode(error_dict(status, message, type, param, code))


class ProtocolError(Exception):
    """A request the API answers with an error; the server sends ``body()`` with ``status``, and a
    ``Retry-After`` header of ``retry_after`` seconds when that is set (429s and 503s that will pass)."""

    def __init__(
        self, status: int, message: str, *, type: str | None = None, param: str | None = None, code: str | None = None,
        retry_after: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.retry_after = retry_after
        default_type, default_code = _error_defaults(status)
        self.status = status
        self.message = message
        self.type = type or default_type
        self.param = param
        self.code = code or default_code

    def body(self) -> bytes:
        """This error as the JSON body of the HTTP response."""
        return error_body(self.status, self.message, self.type, self.param, self.code)


def model_not_found(model: str) -> ProtocolError:
    """The 404 OpenAI sends for a model it does not serve, in its words."""
    return ProtocolError(404, f"The model `{model}` does not exist or you do not have access to it.", param="model")


def _bad(param: str, message: str) -> ProtocolError:
    return ProtocolError(400, message, param=param)


def _unsupported(param: str) -> ProtocolError:
    return _bad(param, f"{param} is not supported")


# ---------------------------------------------------------------- requests


Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
INT32_MAX = 2**31 - 1
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
"""A token id as a request may give it; the server then checks it against the model's vocabulary."""
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_LENGTH)]


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    """Send one last chunk with ``usage`` and no choices before ``[DONE]``."""


class _RequestBase(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields both endpoints share. ``null`` for an optional field means its default, as OpenAI treats it.

    The ranges here are checked as the body is decoded and appear in /openapi.json; checks across fields
    (min_tokens against max_tokens, token ids against the vocabulary) come after.
    """

    model: str
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = 1.0
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_SEQUENCES)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = 0.0
    seed: Int64 | None = None
    user: str | None = None  # accepted and ignored
    logit_bias: dict[str, Annotated[float, msgspec.Meta(ge=-100, le=100)]] | None = None
    """OpenAI's map from token id (as a string) to a bias in [-100, 100]."""
    # tokenmill/vLLM extensions
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)] | None = 0
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = 1.0
    ignore_eos: bool | None = False
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)] | None = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = True
    priority: Int64 = 0
    """Scheduling priority; the server passes it to the engine beside the SamplingParams."""
    vllm_xargs: dict[str, Any] | None = None
    """Arguments for logits processor plugins (vLLM's name); they become ``SamplingParams.extra_args``."""
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """vLLM's: each prompt token's logprob and rank, plus this many alternatives (not with ``stream``)."""
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT_LENGTH)] | None = None
    """vLLM's: requests share prefix-cache blocks only with requests of the same salt (and, with tenants, of
    the same tenant), so a prompt's cached prefix cannot be probed by timing from outside the group."""
    response_format: ResponseFormat | None = None
    """OpenAI's: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": ...}}``
    constrains the output (docs/structured_outputs.md)."""
    structured_outputs: StructuredOutputsParams | None = None
    """vLLM's: one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` constrains the output."""


class CompletionRequest(_RequestBase, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/completions``."""

    # One type for four shapes: msgspec allows one array type per union; completion_prompt() sorts them out.
    prompt: str | list[str | int | list[int]]
    max_tokens: MaxTokens | None = 16  # null: up to the context window
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    # Unknown fields allowed, so an image part decodes and gets a clear "text only" error.
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # the openai client echoes assistant messages back with it


class ChatCompletionRequest(_RequestBase, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: MaxTokens | None = None  # both None: up to the context window
    max_completion_tokens: MaxTokens | None = None  # wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    """``none``, ``auto`` (needs ``--enable-auto-tool-choice``), ``required`` or a named function: the last two
    are enforced by a grammar, so the arguments always match the function's parameters."""
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: extra variables for the chat template (``{"enable_thinking": false}`` for Qwen3's), over the
    server's ``--default-chat-template-kwargs`` key by key."""


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /tokenize`` with a prompt (vLLM's shape): its token ids, as a completion would see them."""

    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /tokenize`` with chat messages (vLLM's shape): the ids of the templated conversation."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    model: str | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    """As in a chat completion request."""


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /detokenize`` (vLLM's shape): token ids back to text."""

    tokens: list[TokenId]
    model: str | None = None


_AT = re.compile(r"^(?P<detail>.*?)(?: - at `\$(?P<path>[^`]*)`)?$")
_FIELD = re.compile(r"field `(?P<name>[^`]+)`")


def _decode(body: bytes, type_: type[_T]) -> _T:
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:  # after ValidationError, its subclass
        if "UTF-8" in str(exc):  # msgspec 0.23 checks strings' UTF-8 itself, before a UnicodeDecodeError could
            _check_utf8(body)
        raise ProtocolError(400, f"request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ProtocolError(400, f"request body is not valid UTF-8 ({exc.reason})") from None
    except RecursionError:
        raise _too_deep("request body") from None


def _check_utf8(body: bytes) -> None:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(400, f"request body is not valid UTF-8 ({exc.reason})") from None


def _too_deep(where: str) -> ProtocolError:
    return ProtocolError(400, f"{where} is nested more than {MAX_JSON_DEPTH} levels deep", param=None)


def _check_free_form(param: str, value: Any) -> None:
    """A free-form JSON field (vllm_xargs, tool_calls) must nest at most MAX_JSON_DEPTH levels and hold only
    integers the engine's wire format can carry (int64 or uint64)."""

    def walk(item: Any, depth: int) -> None:
        if depth > MAX_JSON_DEPTH:
            raise _bad(param, f"{param} is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(item, dict):
            for child in item.values():
                walk(child, depth + 1)
        elif isinstance(item, list):
            for child in item:
                walk(child, depth + 1)
        elif isinstance(item, int) and not INT64_MIN <= item <= UINT64_MAX:
            raise _bad(param, f"{param} holds the integer {item}, outside the 64-bit range")

    walk(value, 0)


def _validation_error(text: str) -> ProtocolError:
    """One line naming the parameter from msgspec's "Expected `float`, got `str` - at `$.temperature`"."""
    match = _AT.match(text)
    assert match is not None  # every string matches: the location part is optional
    # Every optional field also takes null; naming that in "Expected `float | null`" only distracts.
    detail, path = match["detail"].replace(" | null`", "`"), (match["path"] or "").lstrip(".")
    path = path.replace("[...]", "")  # msgspec's mark for "a value of this object", as in logit_bias
    field = _FIELD.search(detail)
    if field is not None:
        param = f"{path}.{field['name']}" if path else field["name"]
        if detail.startswith("Object contains unknown field"):
            return _bad(param, f"unrecognized request argument supplied: {param}")
        if detail.startswith("Object missing required field"):
            return _bad(param, f"missing required parameter: '{param}'")
    if not path:
        return ProtocolError(400, f"request body must be a JSON object: {detail}")
    return _bad(path, f"invalid value for '{path}': {_EXPECTED.sub(_plain_type, detail)}")


_EXPECTED = re.compile(r"^Expected `(?P<type>[^`]+)`")
_TYPE_NAMES = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean", "array": "an array",
               "object": "an object"}  # fmt: skip


def _plain_type(match: re.Match[str]) -> str:
    """msgspec's "Expected `float` >= 0.0" as "expected a number >= 0.0"."""
    return f"expected {_TYPE_NAMES.get(match['type'], '`' + match['type'] + '`')}"


def decode_completion_request(body: bytes) -> tuple[CompletionRequest, SamplingParams]:
    """Decode and check a ``/v1/completions`` body, building its SamplingParams (the one time they are built
    and validated in the front end); raises ProtocolError (400) naming the bad parameter."""
    request = _decode(body, CompletionRequest)
    # From here on a string or a list of token ids (a list is invariant, hence the ignore).
    request.prompt = completion_prompt(request)  # type: ignore[assignment]
    if request.suffix is not None:
        raise _unsupported("suffix")
    if request.best_of is not None and request.best_of != (request.n or 1):
        raise _bad("best_of", "best_of is not supported: leave it out or set it equal to n")
    return request, _check_common(request)


def decode_chat_request(body: bytes, auto_tool_choice: bool = False) -> tuple[ChatCompletionRequest, SamplingParams]:
    """Decode and check a ``/v1/chat/completions`` body, building its SamplingParams once; raises
    ProtocolError (400) naming the bad parameter. ``auto_tool_choice``: the server parses tool calls from
    free text (``--enable-auto-tool-choice``), so ``tool_choice: "auto"`` is allowed."""
    request = _decode(body, ChatCompletionRequest)
    _check_messages(request.messages)
    _check_template_kwargs(request.chat_template_kwargs)
    if request.top_logprobs is not None and not request.logprobs:
        raise _bad("top_logprobs", "top_logprobs requires logprobs to be true")
    for i, tool in enumerate(request.tools or []):
        if tool.function.parameters is not None:
            _check_free_form(f"tools[{i}].function.parameters", tool.function.parameters)
    return request, _check_common(request, auto_tool_choice)


def forced_tool_call(request: CompletionRequest | ChatCompletionRequest) -> ForcedToolCall | None:
    """Whether the request's output is a forced tool call (``tool_choice`` ``required`` or a named function),
    and of which kind; decode_chat_request() has checked the fields."""
    if not isinstance(request, ChatCompletionRequest) or request.tool_choice in (None, "none", "auto"):
        return None
    return _constraint(request, auto_tool_choice=True)[1]


def _constraint(
    request: CompletionRequest | ChatCompletionRequest, auto_tool_choice: bool
) -> tuple[StructuredOutputsParams | None, ForcedToolCall | None]:
    is_chat = isinstance(request, ChatCompletionRequest)
    tools = request.tools if is_chat else None  # type: ignore[union-attr]
    tool_choice = request.tool_choice if is_chat else None  # type: ignore[union-attr]
    parallel = request.parallel_tool_calls if is_chat else None  # type: ignore[union-attr]
    try:
        return request_constraint(
            request.response_format, request.structured_outputs, tools, tool_choice, parallel, auto_tool_choice
        )
    except ToolError as exc:
        raise _bad(exc.param, str(exc)) from None
    except InvalidRequestError as exc:
        raise _bad("response_format", str(exc)) from None


def _check_messages(messages: list[ChatMessage]) -> None:
    for i, message in enumerate(messages):
        if message.content is None and message.role != "assistant":
            # As OpenAI: only an assistant message (one that called tools, or a refusal) may have no content.
            param = f"messages[{i}].content"
            raise _bad(param, f"missing required parameter: '{param}' (a {message.role} message needs content)")
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            if part.type != "text" or part.text is None:
                param = f"messages[{i}].content[{j}]"
                raise _bad(param, f"only text content is supported ({param} has type {part.type!r})")
        if message.tool_calls is not None:
            _check_free_form(f"messages[{i}].tool_calls", message.tool_calls)


def _check_template_kwargs(template_kwargs: dict[str, Any] | None) -> None:
    """``chat_template_kwargs`` is JSON the wire can carry and names no variable the renderer sets itself."""
    if template_kwargs is None:
        return
    _check_free_form("chat_template_kwargs", template_kwargs)
    try:
        check_template_kwargs(template_kwargs)
    except ValueError as exc:
        raise _bad("chat_template_kwargs", str(exc)) from None


def decode_tokenize_request(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """Decode a ``/tokenize`` body: chat messages when it has ``messages``, else a prompt."""
    try:
        fields = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        fields = None  # _decode below reports it
    if not (isinstance(fields, dict) and "messages" in fields):
        return _decode(body, TokenizeCompletionRequest)
    request = _decode(body, TokenizeChatRequest)
    _check_messages(request.messages)
    _check_template_kwargs(request.chat_template_kwargs)
    return request


def decode_detokenize_request(body: bytes) -> DetokenizeRequest:
    """Decode a ``/detokenize`` body."""
    return _decode(body, DetokenizeRequest)


def _check_common(request: CompletionRequest | ChatCompletionRequest, auto_tool_choice: bool = False) -> SamplingParams:
    if request.stream_options is not None and not request.stream:
        raise _bad("stream_options", "stream_options is only allowed when stream is true")
    if request.prompt_logprobs is not None and request.stream:
        raise _bad("prompt_logprobs", "prompt_logprobs is not supported with stream")
    if request.vllm_xargs is not None:
        _check_free_form("vllm_xargs", request.vllm_xargs)
    constraint, _ = _constraint(request, auto_tool_choice)
    # A missing max_tokens stays None: the engine stops at the context window.
    params = _sampling_params(request, _requested_max_tokens(request))
    return msgspec.structs.replace(params, structured_outputs=constraint) if constraint is not None else params


def completion_prompt(request: CompletionRequest) -> str | list[int]:
    """The request's one prompt: text, or token ids. Several prompts (OpenAI's batch form) are a 400.

    decode_completion_request() already stores the result back in ``request.prompt``.
    """
    prompt = request.prompt
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(item, int) for item in prompt):
        prompt = [cast(list[int], prompt)]  # one prompt given as token ids
    if not prompt or not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        raise _bad("prompt", "prompt must be a string, a list of token ids, or a list holding one of either")
    if len(prompt) > 1:
        raise _bad("prompt", "only one prompt per request is supported")
    one = cast(str | list[int], prompt[0])
    if isinstance(one, list) and (not one or min(one) < 0):
        raise _bad("prompt", "a token id prompt must be a non-empty list of ids >= 0")
    return one


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as plain dicts for the chat template; content parts joined with newlines (as vLLM)."""
    plain = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "\n".join(part.text or "" for part in content)
        # Chat templates know "system"; OpenAI's "developer" is its newer name.
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(message, key) is not None:
                entry[key] = getattr(message, key)
        plain.append(entry)
    return plain


def _requested_max_tokens(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


# Request fields SamplingParams takes under the same name and meaning.
_PASSTHROUGH = (
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "seed", "min_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens", "prompt_logprobs",
)  # fmt: skip


def _sampling_params(request: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> SamplingParams:
    fields = {name: getattr(request, name) for name in _PASSTHROUGH}
    fields["stop"] = [request.stop] if isinstance(request.stop, str) else request.stop
    fields["extra_args"] = request.vllm_xargs or None
    if request.logit_bias:
        try:
            fields["logit_bias"] = {int(token_id): bias for token_id, bias in request.logit_bias.items()}
        except ValueError:
            raise _bad("logit_bias", 'logit_bias keys must be token ids, such as {"50256": -100}') from None
    if isinstance(request, ChatCompletionRequest):
        fields["logprobs"] = (request.top_logprobs or 0) if request.logprobs else None
    else:
        fields["logprobs"] = request.logprobs
        if request.echo and request.logprobs is not None:  # the echoed prompt comes with its logprobs
            fields["prompt_logprobs"] = max(request.prompt_logprobs or 0, request.logprobs)
    try:
        # A null field takes SamplingParams' default, which is also OpenAI's.
        return SamplingParams(max_tokens=max_tokens, **{k: v for k, v in fields.items() if v is not None})
    except InvalidRequestError as exc:
        param = str(exc).split("=", 1)[0]  # its messages start with "name=value is invalid"
        if param == "logprobs" and isinstance(request, ChatCompletionRequest):
            param = "top_logprobs"
        raise _bad(param, str(exc)) from None


def check_token_ids(params: SamplingParams, token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    """Every token id a request names (``token_ids``, its prompt's unless ``param`` says otherwise;
    stop_token_ids; logit_bias keys) must be in the vocabulary: a 400 naming the field, before the request
    reaches an engine."""
    named = [(param, token_ids), ("stop_token_ids", params.stop_token_ids),
             ("logit_bias", list(params.logit_bias or ()))]  # fmt: skip
    for param, token_ids in named:
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise _bad(param, f"{param} has token id {bad}, outside the vocabulary [0, {vocab_size})")


def check_context_length(
    request: CompletionRequest | ChatCompletionRequest, params: SamplingParams, prompt_len: int, max_model_len: int
) -> None:
    """Once the prompt is tokenized: an empty prompt is a 400, and a prompt plus ``max_tokens`` over
    ``max_model_len`` (or a prompt that leaves no room at all) is a 400 with OpenAI's wording and code
    ``context_length_exceeded``."""
    is_chat = isinstance(request, ChatCompletionRequest)
    where = "messages" if is_chat else "prompt"
    limit = f"This model's maximum context length is {max_model_len} tokens."
    if prompt_len == 0:
        raise _bad(where, f"the {where} is empty: it must hold at least one token")
    max_tokens = params.max_tokens
    if max_tokens is None:
        if max_model_len - prompt_len < 1:  # nothing left to generate into
            message = (
                f"{limit} However, your {where} resulted in {prompt_len} tokens. "
                f"Please reduce the length of the {where}."
            )
            raise ProtocolError(400, message, param=where, code="context_length_exceeded")
    elif prompt_len + max_tokens > max_model_len:
        message = (
            f"{limit} However, you requested {prompt_len + max_tokens} tokens ({prompt_len} in the {where}, "
            f"{max_tokens} for the completion). Please reduce the length of the {where} or completion."
        )
        param = "messages" if is_chat else "max_tokens"
        raise ProtocolError(400, message, param=param, code="context_length_exceeded")


# ---------------------------------------------------------------- responses


def _finish_reason(reason: str | None) -> str | None:
    # "abort" is not an OpenAI finish reason: an aborted request gets an error, never a normal ending.
    if reason == "abort":
        raise ProtocolError(503, "the request was aborted before it finished; retry it")
    return reason


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def _logprob(value: float) -> float:
    return max(value, _MIN_LOGPROB) if not math.isnan(value) else _MIN_LOGPROB


def _ranked(entries: dict[int, Logprob], num_top_logprobs: int | None) -> list[tuple[int, Logprob]]:
    """Most likely first; the engine's entries are the sampled token plus the top alternatives."""
    ranked = sorted(entries.items(), key=lambda item: item[1].logprob, reverse=True)
    return ranked if num_top_logprobs is None else ranked[:num_top_logprobs]


def completion_logprobs(tokens: list[TextToken], *, text_offset: int = 0,
                        num_top_logprobs: int | None = None) -> dict[str, Any]:  # fmt: skip
    """``/v1/completions`` logprobs: ``{tokens, token_logprobs, top_logprobs, text_offset}``.

    ``tokens`` are the returned text's tokens (``TextToken``): their texts concatenate to it, so a client can
    line logprobs up with the text. ``text_offset`` is where the first one starts in the returned text (a
    stream passes its running offset). With ``num_top_logprobs`` None the top dicts hold every entry the
    engine sent; the alternatives' texts are each token decoded on its own.
    """
    result: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token in tokens:
        result["tokens"].append(token.text)
        if token.token_id not in token.logprobs:  # an echoed prompt's first token: nothing precedes it
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
        else:
            result["token_logprobs"].append(_logprob(token.logprobs[token.token_id].logprob))
            top = {lp.decoded_token: _logprob(lp.logprob) for _, lp in _ranked(token.logprobs, num_top_logprobs)}
            result["top_logprobs"].append(top)
        result["text_offset"].append(text_offset)
        text_offset += len(token.text)
    return result


def chat_logprobs(tokens: list[TextToken], *, num_top_logprobs: int | None = None) -> dict[str, Any]:
    """``/v1/chat/completions`` logprobs: ``{content: [{token, logprob, bytes, top_logprobs}]}`` for the
    returned text's tokens; their ``token`` strings (and ``bytes``) concatenate to the message content."""

    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}

    content = []
    for token in tokens:
        top = [entry(lp.decoded_token, lp.logprob) for _, lp in _ranked(token.logprobs, num_top_logprobs)]
        content.append({**entry(token.text, token.logprobs[token.token_id].logprob), "top_logprobs": top})
    return {"content": content}


def _envelope(request_id: str, obj: str, created: int, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}


@dataclass(frozen=True)
class Echo:
    """The prompt a completion echoes (``echo``): its text and, when logprobs are asked for, its tokens."""

    text: str
    tokens: list[TextToken] | None


def prompt_logprobs_json(prompt_logprobs: list[dict[int, Logprob] | None]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    return [
        None if entries is None else {
            str(token_id): {"logprob": _logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in entries.items()
        }
        for entries in prompt_logprobs
    ]  # fmt: skip


def _full_response(chat: bool, request_id: str, model: str, created: int, outputs: RequestOutput, prompt_tokens: int,
                   num_top_logprobs: int | None, echo: Echo | None = None) -> dict[str, Any]:  # fmt: skip
    assert outputs.finished, "a full response needs every completion finished"
    prompt_logprobs = prompt_logprobs_json(outputs.prompt_logprobs) if outputs.prompt_logprobs is not None else None
    choices = []
    for c in sorted(outputs.outputs, key=lambda c: c.index):
        choice: dict[str, Any] = {"index": c.index, "finish_reason": _finish_reason(c.finish_reason), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = echo.text + c.text if echo else c.text
        if c.text_tokens is not None:
            if chat:
                choice["logprobs"] = chat_logprobs(c.text_tokens, num_top_logprobs=num_top_logprobs)
            else:
                tokens = [*echo.tokens, *c.text_tokens] if echo and echo.tokens is not None else c.text_tokens
                choice["logprobs"] = completion_logprobs(tokens, num_top_logprobs=num_top_logprobs)
        if prompt_logprobs is not None and not chat:
            choice["prompt_logprobs"] = prompt_logprobs  # vLLM: per choice in completions
        choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for c in outputs.outputs)
    obj = "chat.completion" if chat else "text_completion"
    response = {
        **_envelope(request_id, obj, created, model, choices),
        "usage": _usage(prompt_tokens, completion_tokens),
    }
    if prompt_logprobs is not None and chat:
        response["prompt_logprobs"] = prompt_logprobs  # vLLM: once, beside the choices, in chat
    return response


def completion_response(request_id: str, model: str, created: int, outputs: RequestOutput, prompt_tokens: int, *,
                        num_top_logprobs: int | None = None, echo: Echo | None = None) -> dict[str, Any]:  # fmt: skip
    """A finished ``/v1/completions`` response (``openai.types.Completion``); ``request_id`` is its ``id``.

    Pass the request's ``logprobs`` as ``num_top_logprobs`` for OpenAI's number
    of alternatives, and with ``echo`` the prompt each text starts with (its tokens
    lead the logprobs). An aborted choice raises ProtocolError (503).
    """
    return _full_response(False, request_id, model, created, outputs, prompt_tokens, num_top_logprobs, echo)


def chat_response(request_id: str, model: str, created: int, outputs: RequestOutput, prompt_tokens: int, *,
                  num_top_logprobs: int | None = None) -> dict[str, Any]:  # fmt: skip
    """A finished ``/v1/chat/completions`` response (``openai.types.chat.ChatCompletion``).

    Pass the request's ``top_logprobs or 0`` as ``num_top_logprobs``. An aborted
    choice raises ProtocolError (503).
    """
    return _full_response(True, request_id, model, created, outputs, prompt_tokens, num_top_logprobs)


def completion_chunk(request_id: str, model: str, created: int, index: int, text: str, finish_reason: str | None = None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """One streamed ``/v1/completions`` chunk: new ``text`` of choice ``index`` (logprobs from completion_logprobs)."""
    choice = {"index": index, "text": text, "finish_reason": _finish_reason(finish_reason), "logprobs": logprobs}
    return _envelope(request_id, "text_completion", created, model, [choice])


def chat_chunk(request_id: str, model: str, created: int, index: int, delta: dict[str, Any],
               finish_reason: str | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """One streamed chat chunk (``ChatCompletionChunk``) for choice ``index``.

    Per choice, as OpenAI: first ``delta={"role": "assistant", "content": ""}``,
    then ``{"content": text}`` for each piece, last ``{}`` with the finish_reason.
    """
    choice = {"index": index, "delta": delta, "finish_reason": _finish_reason(finish_reason), "logprobs": logprobs}
    return _envelope(request_id, "chat.completion.chunk", created, model, [choice])


def usage_chunk(request_id: str, model: str, created: int,
                object_type: Literal["text_completion", "chat.completion.chunk"],
                prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:  # fmt: skip
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the request's usage.

    ``object_type`` is the stream's chunk type: "text_completion" or "chat.completion.chunk".
    """
    assert object_type in ("text_completion", "chat.completion.chunk"), object_type
    envelope = _envelope(request_id, object_type, created, model, [])
    return {**envelope, "usage": _usage(prompt_tokens, completion_tokens)}


def sse_event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event, ``b"data: <json>\\n\\n"``; ``sse_event("[DONE]")`` ends an OpenAI stream."""
    payload = data.encode() if isinstance(data, str) else msgspec.json.encode(data)
    assert b"\n" not in payload, "a newline would split the event"
    return b"data: " + payload + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
"""The event that ends every OpenAI stream."""


def tokenize_response(tokens: list[int], max_model_len: int, token_strs: list[str] | None) -> dict[str, Any]:
    """``POST /tokenize``, vLLM's shape."""
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": token_strs}


def model_response(model_id: str, created: int, owned_by: str = "tokenmill") -> dict[str, Any]:
    """``GET /v1/models/{id}``: one ``openai.types.Model``."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}


def models_response(model_ids: list[str], created: int, owned_by: str = "tokenmill") -> dict[str, Any]:
    """``GET /v1/models``: a list of ``openai.types.Model``."""
    return {"object": "list", "data": [model_response(id_, created, owned_by) for id_ in model_ids]}
