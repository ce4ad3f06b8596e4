"""Tools and structured outputs on the wire: OpenAI's ``response_format``, ``tools`` and ``tool_choice``, and
vLLM's ``structured_outputs`` field, turned into one ``StructuredOutputsParams``; and a forced tool call's
output turned back into OpenAI ``tool_calls`` (whole, or as streamed argument deltas).

As vLLM does, ``tool_choice: "required"`` constrains the output to a JSON array of calls, each
``{"name": <one of the tools>, "parameters": <that tool's parameters schema>}`` (one call unless
``parallel_tool_calls``), and a named function constrains it to that function's parameters: the arguments
always parse and match the schema. ``tool_choice: "auto"`` needs the server's tool-call parser
(``tokenmill.server.parsing``). Pure functions and msgspec structs; never imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from tokenmill.parsers.json_calls import PartialCall, scan_calls
from tokenmill.parsers.tool_parser import ToolCall, openai_tool_calls
from tokenmill.sampling_params import StructuredOutputsParams


class ToolError(ValueError):
    """A request's tools or formats do not fit together; ``param`` names the field at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ForcedToolCall:
    """How a request's output becomes tool calls: ``name`` set, the output is that function's arguments;
    unset (``required``), a JSON array of ``{"name", "parameters"}``."""

    name: str | None = None


_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _ANY_OBJECT


def required_schema(tools: list[ChatTool], parallel_tool_calls: bool) -> dict[str, Any]:
    """The schema of ``tool_choice: "required"``: an array of at least one call (exactly one unless
    ``parallel_tool_calls``), each naming a tool and giving arguments valid against its parameters."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": _parameters(tool)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def request_constraint(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputsParams | None,
    tools: list[ChatTool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    auto_tool_choice: bool = False,
) -> tuple[StructuredOutputsParams | None, ForcedToolCall | None]:
    """The one constraint a request asks for, and whether its output becomes tool calls. Raises ``ToolError``
    when the fields conflict, a named function is not among ``tools``, or ``auto`` is asked of a server that
    cannot parse tool calls (``auto_tool_choice``: ``--enable-auto-tool-choice``)."""
    constraint = structured_outputs
    if response_format is not None and response_format.type != "text":
        if constraint is not None:
            raise ToolError("response_format", "give either response_format or structured_outputs, not both")
        if response_format.type == "json_object":
            constraint = StructuredOutputsParams(json_object=True)
        else:
            spec = response_format.json_schema
            if spec is None:
                raise ToolError("response_format.json_schema", "response_format json_schema needs its json_schema")
            constraint = StructuredOutputsParams(
                json=spec.schema if spec.schema is not None else _ANY_OBJECT,
                disable_additional_properties=bool(spec.strict),
            )
    if tool_choice is not None and not tools and tool_choice != "none":
        raise ToolError("tool_choice", "tool_choice is only allowed when tools are given")
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice in ("none", "auto"):
        if choice == "auto" and tools and not auto_tool_choice:
            raise ToolError(
                "tool_choice",
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set; '
                'use "required" or a named function, which need neither',
            )
        return constraint, None
    assert tools
    if constraint is not None:
        raise ToolError("tool_choice", "a forced tool call cannot be combined with response_format or "
                                       "structured_outputs")  # fmt: skip
    if choice == "required":
        schema = required_schema(tools, parallel_tool_calls is not False)
        return StructuredOutputsParams(json=schema), ForcedToolCall()
    assert isinstance(choice, NamedToolChoice)
    tool = next((t for t in tools if t.function.name == choice.function.name), None)
    if tool is None:
        names = ", ".join(t.function.name for t in tools)
        raise ToolError("tool_choice", f"tool_choice names function {choice.function.name!r}, which is not among "
                                       f"the tools ({names})")  # fmt: skip
    return StructuredOutputsParams(json=_parameters(tool)), ForcedToolCall(choice.function.name)


def forced_calls(forced: ForcedToolCall) -> Callable[[str], list[PartialCall]]:
    """How a forced tool call's output so far reads as calls: a named function's output is its arguments; the
    ``required`` array's elements are ``{"name", "parameters"}`` objects."""
    if forced.name is not None:
        name = forced.name
        return lambda text: [(name, text)]
    return lambda text: scan_calls(text, ("parameters",))


def tool_calls(forced: ForcedToolCall, text: str) -> list[dict[str, Any]] | None:
    """The OpenAI ``tool_calls`` of a finished output, or None when it does not parse (cut short by
    ``max_tokens``)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if forced.name is None and not (isinstance(value, list) and value):
        return None
    # The arguments as the model wrote them, as a stream sends them.
    calls = [ToolCall(name, arguments.strip()) for name, arguments in forced_calls(forced)(text) if name is not None]
    return openai_tool_calls(calls)
