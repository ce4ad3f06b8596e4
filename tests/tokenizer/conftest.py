"""Fixtures for the tokenizer tests.

Loading a tokenizer (ours from a GGUF, or transformers' reference) takes
seconds, so each one is loaded once for the whole package.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tests.tokenizer.synthetic_gguf import write_llama_gguf
from tokenmill.tokenizer import Tokenizer

# Text the tokenizers must agree on: ASCII, code, CJK, emoji, whitespace runs, digits and special tokens.
CORPUS = [
    "",
    "Hello world",
    "hello world! The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "multiple    spaces   between",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\nline four\r\nwindows\n",
    "\n\n\n",
    "   \t \n  ",
    "def foo(x):\n    return x == 1  # comment\n\tpass\n",
    'if (a < b && c > d) { printf("%d\\n", a[0]); }',
    "中文测试，你好世界。",
    "日本語のテキストと한국어",
    "emoji 🙂🎉 and ZWJ 👩‍👩‍👧‍👦 and flag 🇫🇷 and skin tone 👍🏽",
    "café naïve résumé — “quotes” ‘single’ …",
    "Ünïcödé ÀÉÎÕÜ ß ø å",
    "مرحبا بالعالم",
    "Zalgo: Z̷̢͉a̶l̸g̴o̵",
    "numbers 12345 3.14159 1,000,000 2024-01-01 v1.2.3",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more text<|endoftext|>",
    "<s>hello</s> <unk> <think>reasoning</think> <tool>",
    "a" * 50 + " " + "ab" * 20,
    "I'm sure they'll say we've done it, don't you think?",
    "URL https://example.com/path?q=1&r=2#frag and email a.b@example.org",
    "\u00a0non-breaking\u2003em space\u200bzero width",
]


@pytest.fixture(scope="package")
def transformers_module() -> Any:
    transformers = pytest.importorskip("transformers")
    # transformers' own logging is chatty about GGUF conversion; keep test output readable.
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers


@pytest.fixture(scope="package")
def smollm2_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    """Ours, rebuilt from the default model's GGUF metadata."""
    return Tokenizer.from_path(smollm2_gguf)


@pytest.fixture(scope="package")
def hf_smollm2(smollm2_gguf: Path, transformers_module: Any) -> Any:
    """transformers' tokenizer for the same GGUF: the reference."""
    return transformers_module.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="package")
def tiny_llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("tiny_llama") / "tiny-llama.gguf")


@pytest.fixture(scope="package")
def tiny_llama_tokenizer(tiny_llama_gguf: Path) -> Tokenizer:
    return Tokenizer.from_path(tiny_llama_gguf)


@pytest.fixture(scope="package")
def hf_tiny_llama(tiny_llama_gguf: Path, transformers_module: Any) -> Any:
    return transformers_module.AutoTokenizer.from_pretrained(
        str(tiny_llama_gguf.parent), gguf_file=tiny_llama_gguf.name
    )
