"""First-party tool-call parsers (slot ``tool_parser``, ``--tool-call-parser``): ``hermes`` (Hermes and Qwen's
``<tool_call>{json}</tool_call>``), ``llama3_json`` (Llama 3.x's bare JSON calls) and ``mistral``
(``[TOOL_CALLS][...]``); and reasoning parsers (slot ``reasoning_parser``, ``--reasoning-parser``):
``deepseek_r1`` and ``qwen3`` (``<think>...</think>``). vLLM's names and formats.
"""
