"""Tool-call and reasoning parsers: a model's text turned into OpenAI ``tool_calls`` and ``reasoning_content``.

``tool_parser`` holds the ``ToolParser`` interface (slot ``tool_parser``, ``--tool-call-parser``) and
``reasoning_parser`` the ``ReasoningParser`` interface (slot ``reasoning_parser``, ``--reasoning-parser``);
``json_calls`` scans JSON tool calls as they stream. The parsers themselves are plugins (first party:
``tokenmill_plugins.parsers``). Imports no torch: the API front end uses them.
"""

from tokenmill.parsers.reasoning_parser import ReasoningParser
from tokenmill.parsers.tool_parser import ExtractedToolCalls, ToolCall, ToolParser

__all__ = ["ExtractedToolCalls", "ReasoningParser", "ToolCall", "ToolParser"]
