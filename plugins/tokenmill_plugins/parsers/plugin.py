"""Registers the first-party tool-call and reasoning parsers (registration only: imports nothing heavy)."""

from __future__ import annotations

from tokenmill import hookimpl
from tokenmill.hookspecs import Register

_TOOLS = "tokenmill_plugins.parsers.tool_parsers"
_REASONING = "tokenmill_plugins.parsers.reasoning_parsers"


@hookimpl
def tokenmill_register_tool_parsers(register: Register) -> None:
    register("hermes", f"{_TOOLS}:HermesToolParser")
    register("llama3_json", f"{_TOOLS}:Llama3JsonToolParser")
    register("mistral", f"{_TOOLS}:MistralToolParser")


@hookimpl
def tokenmill_register_reasoning_parsers(register: Register) -> None:
    register("deepseek_r1", f"{_REASONING}:DeepSeekR1ReasoningParser")
    register("qwen3", f"{_REASONING}:Qwen3ReasoningParser")
