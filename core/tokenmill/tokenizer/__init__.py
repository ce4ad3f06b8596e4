"""Tokenizers: encode/decode, chat templates and streaming detokenization.

Built from a Hugging Face model directory or a GGUF file with the
``tokenizers``, ``jinja2`` and ``gguf`` packages; never imports ``torch`` or
``transformers``, so the API front end can use it cheaply. The names below are
imported on first use: a module that needs only the chat template's checks
(the request protocol) does not import ``gguf`` and numpy with them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill._lazy import lazy_getattr

if TYPE_CHECKING:
    from tokenmill.tokenizer.chat_template import RESERVED_TEMPLATE_VARIABLES as RESERVED_TEMPLATE_VARIABLES
    from tokenmill.tokenizer.chat_template import ChatTemplate as ChatTemplate
    from tokenmill.tokenizer.chat_template import check_template_kwargs as check_template_kwargs
    from tokenmill.tokenizer.chat_template import render_chat_template as render_chat_template
    from tokenmill.tokenizer.detokenizer import IncrementalDetokenizer as IncrementalDetokenizer
    from tokenmill.tokenizer.tokenizer import Tokenizer as Tokenizer

_EXPORTS = {
    "RESERVED_TEMPLATE_VARIABLES": "tokenmill.tokenizer.chat_template",
    "ChatTemplate": "tokenmill.tokenizer.chat_template",
    "IncrementalDetokenizer": "tokenmill.tokenizer.detokenizer",
    "Tokenizer": "tokenmill.tokenizer.tokenizer",
    "check_template_kwargs": "tokenmill.tokenizer.chat_template",
    "render_chat_template": "tokenmill.tokenizer.chat_template",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
