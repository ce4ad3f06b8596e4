"""What a tokenizer file yields before it becomes a ``Tokenizer``.

Both sources we read (a Hugging Face model directory and a GGUF file) are
reduced to one ``TokenizerSource``. The ``Tokenizer`` then applies the rules
that are the same for both: named special tokens become special added tokens,
and explicit ``add_bos_token``/``add_eos_token`` flags rebuild the
post-processor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import tokenizers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizerSource:
    """A backend tokenizer plus the settings that its file stores beside it."""

    path: Path
    """The file or directory this came from, for error messages and logs."""
    backend: tokenizers.Tokenizer
    """Vocabulary, merges, pre-tokenizer and decoder; mutated once by ``Tokenizer``."""
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    extra_special_tokens: tuple[str, ...] = ()
    """More tokens the config names as special; matched whole and skipped on decode."""
    add_bos_token: bool | None = None
    """``None`` keeps the backend's own post-processor (Hugging Face does the same)."""
    add_eos_token: bool | None = None
    extra_eos_token_ids: tuple[int, ...] = ()
    """Ids besides ``eos_token`` that end generation (generation_config, GGUF eot/eom)."""
    chat_template: str | None = None
