"""Tokenizers: encode/decode, chat templates and streaming detokenization.

Built from a Hugging Face model directory or a GGUF file with the
``tokenizers``, ``jinja2`` and ``gguf`` packages; never imports ``torch`` or
``transformers``, so the API front end can use it cheaply.
"""

from __future__ import annotations

from tokenmill.tokenizer.chat_template import (
    RESERVED_TEMPLATE_VARIABLES,
    ChatTemplate,
    check_template_kwargs,
    render_chat_template,
)
from tokenmill.tokenizer.detokenizer import IncrementalDetokenizer
from tokenmill.tokenizer.tokenizer import Tokenizer

__all__ = [
    "RESERVED_TEMPLATE_VARIABLES",
    "ChatTemplate",
    "IncrementalDetokenizer",
    "Tokenizer",
    "check_template_kwargs",
    "render_chat_template",
]
