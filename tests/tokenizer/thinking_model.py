"""A tiny random model whose chat template branches on two variables, as Qwen3's does on ``enable_thinking``:
``enable_thinking=False`` closes an empty thinking block in the prompt, and ``persona`` adds a line. Tests that
pass template variables (``chat_template_kwargs``) compare the prompt with what the branches write."""

from __future__ import annotations

from pathlib import Path

from tokenmill.testing import save_tiny_model

THINKING_TEMPLATE = """{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if persona is defined %}
{{- 'As ' + persona + ': ' }}
{%- endif %}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}"""

#: The prompt for one user message "hi", up to where the branches write.
PROMPT_START = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
THINKING_OFF = "<think>\n\n</think>\n\n"


def save_thinking_model(directory: Path) -> Path:
    """``save_tiny_model`` with ``THINKING_TEMPLATE`` as its ``chat_template.jinja`` (which wins over the
    tokenizer config's template); returns ``directory``."""
    save_tiny_model(directory)
    (directory / "chat_template.jinja").write_text(THINKING_TEMPLATE, encoding="utf-8")
    return directory
