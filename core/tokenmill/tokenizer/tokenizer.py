"""The tokenizer: text to token ids and back, plus the model's chat template.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (Hugging Face's Rust
tokenizers) built from a Hugging Face model directory or a GGUF file. It does
not import ``transformers`` or ``torch``: the API front end uses it and never
loads either.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from tokenmill.gguf_metadata import has_gguf_magic
from tokenmill.tokenizer.chat_template import ChatTemplate
from tokenmill.tokenizer.gguf_tokenizer import load_gguf_tokenizer
from tokenmill.tokenizer.hf_tokenizer import TOKENIZER_FILE, load_hf_tokenizer
from tokenmill.tokenizer.source import TokenizerSource

logger = logging.getLogger(__name__)


class Tokenizer:
    """Encodes and decodes text for one model, and renders its chat template.

    Build it with ``Tokenizer.from_path``. Encoding and decoding match
    ``transformers``' tokenizer for the same files. The object is read-only
    after construction and safe to share between threads.
    """

    def __init__(self, source: TokenizerSource) -> None:
        """Finish ``source.backend`` (special tokens, post-processor) and read the token ids.

        ``source.backend`` is modified in place; do not share it.
        """
        self.path = source.path
        self._backend = source.backend
        self.bos_token = source.bos_token
        self.eos_token = source.eos_token
        self.unk_token = source.unk_token
        self.pad_token = source.pad_token
        self.chat_template = source.chat_template
        self._compiled_template: ChatTemplate | None = None

        # Named special tokens are matched whole in text and skipped on decode,
        # even when the vocabulary has them as ordinary tokens (transformers does the same).
        named = [source.bos_token, source.eos_token, source.unk_token, source.pad_token, *source.extra_special_tokens]
        added = {token.content for token in self._backend.get_added_tokens_decoder().values()}
        missing = [t for t in dict.fromkeys(named) if t is not None and t not in added]
        if missing:
            self._backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])

        self.bos_token_id = self._token_id(self.bos_token)
        self.eos_token_id = self._token_id(self.eos_token)
        self.unk_token_id = self._token_id(self.unk_token)
        self.pad_token_id = self._token_id(self.pad_token)
        stop_ids = [] if self.eos_token_id is None else [self.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*stop_ids, *source.extra_eos_token_ids]))
        """Every id that ends generation: ``eos_token_id`` first, then generation_config / GGUF eot ids."""

        if source.add_bos_token is not None or source.add_eos_token is not None:
            self._set_post_processor(bool(source.add_bos_token), bool(source.add_eos_token))

        self.vocab_size: int = self._backend.get_vocab_size(with_added_tokens=True)
        """Number of token ids, added tokens included."""
        self._special_ids = frozenset(
            token_id for token_id, token in self._backend.get_added_tokens_decoder().items() if token.special
        )
        logger.debug(
            "tokenizer from %s: vocab %d, bos %s, eos %s",
            self.path,
            self.vocab_size,
            self.bos_token_id,
            self.eos_token_ids,
        )

    @classmethod
    def from_path(cls, path: Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model directory or a ``.gguf`` file.

        Raises ``ValueError`` with a one-line message naming the file when no
        tokenizer can be built from ``path``.
        """
        path = Path(path)
        if path.is_dir():
            return cls(load_hf_tokenizer(path))
        if path.is_file():
            if path.suffix.lower() == ".gguf" or has_gguf_magic(path):
                return cls(load_gguf_tokenizer(path))
            if path.name == TOKENIZER_FILE:  # a tokenizer.json given directly: use its directory
                return cls(load_hf_tokenizer(path.parent))
            raise ValueError(f"{path}: not a .gguf file; give a Hugging Face model directory or a GGUF file")
        raise ValueError(f"{path}: no such file or directory")

    # -- encoding and decoding ---------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        With ``add_special_tokens`` the model's post-processor adds what it is
        configured to (for example BOS); special token strings inside ``text``
        always map to their ids.
        """
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``; incomplete UTF-8 at the end decodes to U+FFFD."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of ``token_ids``; raises ``ValueError`` for an unknown id."""
        tokens = []
        for token_id in token_ids:
            token = self._backend.id_to_token(token_id)
            if token is None:
                raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
            tokens.append(token)
        return tokens

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string, or ``None`` if it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token (dropped by ``skip_special_tokens``)."""
        return token_id in self._special_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of all special tokens."""
        return self._special_ids

    # -- chat template -----------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the model's chat template.

        The template sees ``messages``, ``add_generation_prompt``, the special
        token strings (``bos_token``, ``eos_token``, ``unk_token``,
        ``pad_token``), ``tools=None``, ``documents=None`` and
        ``template_kwargs``, which override the rest. With ``tokenize`` the text
        is encoded without adding special tokens (the template writes them).
        Raises ``ValueError`` when the model has no template or it fails.
        """
        if self.chat_template is None:
            raise ValueError(f"{self.path}: the model has no chat template; use render_chat_template() with one")
        if self._compiled_template is None:
            self._compiled_template = ChatTemplate(self.chat_template)
        variables: dict[str, Any] = {**self.special_tokens_map(), **template_kwargs}
        text = self._compiled_template.render(messages, add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def special_tokens_map(self) -> Mapping[str, str]:
        """The named special tokens that are set, as chat templates see them."""
        named = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }
        return {name: token for name, token in named.items() if token is not None}

    # -- internals ---------------------------------------------------------------------------

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        """Explicit flags (GGUF metadata) replace the post-processor, as transformers does."""
        prefix: list[str] = []
        suffix: list[str] = []
        special: list[tuple[str, int]] = []
        if add_bos and self.bos_token is not None and self.bos_token_id is not None:
            prefix = [self.bos_token]
            special.append((self.bos_token, self.bos_token_id))
        if add_eos and self.eos_token is not None and self.eos_token_id is not None:
            suffix = [self.eos_token]
            special.append((self.eos_token, self.eos_token_id))
        single = [*prefix, "$A", *suffix]
        pair = [*single, *[f"{t}:1" for t in prefix], "$B:1", *[f"{t}:1" for t in suffix]]
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(dict.fromkeys(special))
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``, for batch encoding and offsets."""
        return self._backend
