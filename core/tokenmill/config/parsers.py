"""Tool-call and reasoning parsers: how the API front end reads tool calls and thinking out of a model's text
(docs/structured_outputs.md#parsers). vLLM's flags::

    tokenmill serve MODEL --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3
"""

from __future__ import annotations

from typing import Annotated

from tokenmill.config.base import ConfigSection, describe


class ParsersConfig(ConfigSection, frozen=True):
    enable_auto_tool_choice: Annotated[
        bool,
        describe(
            "Allow tool_choice 'auto' (the default when a request has tools): the model writes freely and "
            "tool_call_parser reads its tool calls out of the text. Needs tool_call_parser."
        ),
    ] = False
    tool_call_parser: Annotated[
        str | None,
        describe(
            "Tool-call parser plugin by name, for the model's own format: 'hermes' (Hermes, Qwen 2.5/3: "
            "<tool_call>{json}</tool_call>), 'llama3_json' (Llama 3.x JSON calls) or 'mistral' "
            "([TOOL_CALLS][...]; from tokenizer v11, [TOOL_CALLS]name[ARGS]{json})."
        ),
    ] = None
    reasoning_parser: Annotated[
        str | None,
        describe(
            "Reasoning parser plugin by name: 'deepseek_r1' or 'qwen3' split <think>...</think> into a chat "
            "message's reasoning_content; a structured-output constraint then starts after </think>."
        ),
    ] = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "parsers.enable_auto_tool_choice needs parsers.tool_call_parser (--tool-call-parser NAME): "
                "name the model's tool-call format, e.g. 'hermes'"
            )
