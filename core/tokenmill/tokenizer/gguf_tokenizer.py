"""Rebuilding a tokenizer from a GGUF file's metadata.

A GGUF file has no ``tokenizer.json``. It stores the vocabulary, the token
types, the merges (or SentencePiece scores) and the special token ids under
llama.cpp's ``tokenizer.ggml.*`` keys. We read those through
``tokenmill.gguf_metadata`` and assemble an equivalent ``tokenizers.Tokenizer``:

- ``gpt2``: byte-level BPE. Tokens are already spelled in the GPT-2 byte
  alphabet; the text split regex is picked from ``tokenizer.ggml.pre``.
- ``llama``: SentencePiece-style BPE with byte fallback (``<0xE2>`` tokens),
  ``▁`` for spaces and an optional prefix space. Merges come from the file or
  are derived from the token scores.

The result matches what Hugging Face ``transformers`` builds for the same file
(the tests check this), with the deviations noted where they are made.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from tokenmill.gguf_metadata import GGUFMetadata
from tokenmill.tokenizer.source import TokenizerSource

logger = logging.getLogger(__name__)

_KEY_PREFIX = "tokenizer."

_GPT2_TYPE = "gpt2"
_LLAMA_TYPE = "llama"
SUPPORTED_MODEL_TYPES = (_GPT2_TYPE, _LLAMA_TYPE)

# llama.cpp's text split for each `tokenizer.ggml.pre` family. The plain GPT-2
# regex (ByteLevel's own) is the fallback, as in transformers.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# These split every digit off first, then apply the GPT-2 regex (llama.cpp's
# `\p{N}` + GPT-2 rule, and the `Digits` step in these models' tokenizer.json).
# transformers uses the bare GPT-2 regex here. ASCII digits come out the same
# (no merges across digits exist), but for " ½" it keeps the space merged in.
_DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})
_GPT2_PRES = frozenset({"default", "gpt-2", "gpt2"})


def load_gguf_tokenizer(path: Path) -> TokenizerSource:
    """Read ``path``'s tokenizer metadata and build the tokenizer it describes.

    Called once per model load, in whichever process needs a tokenizer.
    Raises ``ValueError`` naming the file when it is not a GGUF file (a
    ``GGUFError``), has no tokenizer metadata, or uses a tokenizer model type
    we do not build.
    """
    metadata = GGUFMetadata.open(path).with_prefix(_KEY_PREFIX)
    return build_gguf_tokenizer(metadata, path)


def build_gguf_tokenizer(metadata: dict[str, Any], path: Path) -> TokenizerSource:
    """Build from already decoded ``tokenizer.*`` metadata (key -> Python value)."""

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(_KEY_PREFIX + key, default)

    model_type = get("ggml.model")
    tokens: list[str] | None = get("ggml.tokens")
    if model_type is None or not tokens:
        raise ValueError(f"{path}: GGUF file has no tokenizer metadata (tokenizer.ggml.model/tokens)")
    token_types: list[int] = get("ggml.token_type") or [int(gguf.TokenType.NORMAL)] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens")
    merges = [_split_merge(merge) for merge in get("ggml.merges") or ()]

    add_bos_token: bool | None = get("ggml.add_bos_token")
    if model_type == _GPT2_TYPE:
        backend = _byte_level_backend(tokens, token_types, merges, get("ggml.pre"))
    elif model_type == _LLAMA_TYPE:
        scores: list[float] | None = get("ggml.scores")
        if not merges:
            if scores is None or len(scores) != len(tokens):
                raise ValueError(f"{path}: llama tokenizer has neither merges nor one score per token")
            merges = _merges_from_scores(tokens, token_types, scores)
        unk_id = get("ggml.unknown_token_id")
        add_space_prefix = bool(get("ggml.add_space_prefix", True))
        backend = _sentencepiece_backend(tokens, token_types, merges, unk_id, add_space_prefix)
        if add_bos_token is None:
            add_bos_token = True  # llama.cpp and transformers both default to BOS for SentencePiece vocabularies
    else:
        raise ValueError(
            f"{path}: GGUF tokenizer model {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )

    def token_at(key: str) -> str | None:
        token_id = get(key)
        if token_id is None or not 0 <= token_id < len(tokens):
            return None
        return tokens[token_id]

    eos_token_id = get("ggml.eos_token_id")
    # End-of-turn / end-of-message tokens also stop generation in llama.cpp.
    extra_eos = tuple(
        token_id
        for token_id in (get("ggml.eot_token_id"), get("ggml.eom_token_id"))
        if token_id is not None and token_id != eos_token_id and 0 <= token_id < len(tokens)
    )
    return TokenizerSource(
        path=path,
        backend=backend,
        bos_token=token_at("ggml.bos_token_id"),
        eos_token=token_at("ggml.eos_token_id"),
        unk_token=token_at("ggml.unknown_token_id"),
        pad_token=token_at("ggml.padding_token_id"),
        add_bos_token=add_bos_token,
        add_eos_token=get("ggml.add_eos_token"),
        extra_eos_token_ids=extra_eos,
        chat_template=get("chat_template"),
    )


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise ValueError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
    return left, right


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


def _byte_level_backend(
    tokens: Sequence[str], token_types: Sequence[int], merges: list[tuple[str, str]], pre: str | None
) -> tokenizers.Tokenizer:
    spelling = _byte_alphabet()
    alphabet = frozenset(spelling.values())
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        # A few converters store some tokens as raw text; respell them in the byte alphabet.
        key = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        if key in vocab:
            logger.warning(
                "GGUF vocabulary spells token %d like token %d (%r); keeping the first", token_id, vocab[key], key
            )
            continue
        vocab[key] = token_id
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    # Only tokens spelled in the byte alphabet can be added whole: the others would need a new id.
    # transformers skips them too (they are llama.cpp mislabels).
    _add_typed_tokens(backend, tokens, token_types, lambda token: set(token) <= alphabet)
    return backend


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    split = _REGEX_SPLITS.get(pre or "")
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre is not None and pre not in _GPT2_PRES:
        logger.warning("unknown tokenizer.ggml.pre %r; splitting text with the GPT-2 regex", pre)
    return byte_level


def _sentencepiece_backend(
    tokens: Sequence[str],
    token_types: Sequence[int],
    merges: list[tuple[str, str]],
    unk_id: int | None,
    add_space_prefix: bool,
) -> tokenizers.Tokenizer:
    vocab = {token: token_id for token_id, token in reversed(list(enumerate(tokens)))}  # first id wins
    unk_token = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    # add_space_prefix=False ("never", no Strip) follows llama.cpp; transformers ignores the flag.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps: list[decoders.Decoder] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))  # drop the prefix space added on encode
    backend.decoder = decoders.Sequence(steps)
    _add_typed_tokens(backend, tokens, token_types, lambda token: token in vocab)
    return backend


def _add_typed_tokens(
    backend: tokenizers.Tokenizer,
    tokens: Sequence[str],
    token_types: Sequence[int],
    can_add: Callable[[str], bool],
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens.

    Either way they are matched whole in input text instead of being cut into pieces.
    """
    control = int(gguf.TokenType.CONTROL)
    user_defined = int(gguf.TokenType.USER_DEFINED)
    special = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == control and can_add(token)
    ]
    plain = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == user_defined and can_add(token)
    ]
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


def _merges_from_scores(
    tokens: Sequence[str], token_types: Sequence[int], scores: Sequence[float]
) -> list[tuple[str, str]]:
    """SentencePiece BPE merges two pieces when the joined piece is in the vocabulary, best score first.

    Every way of cutting a normal token into two known tokens is a candidate merge, ranked by the
    joined token's score; ties go to the longer left, then longer right piece (transformers' order).
    """
    vocab = {token: token_id for token_id, token in reversed(list(enumerate(tokens)))}
    normal = int(gguf.TokenType.NORMAL)
    candidates: list[tuple[float, int, int, str, str]] = []
    for token_id, token in enumerate(tokens):
        if token_types[token_id] != normal or len(token) < 2 or vocab[token] != token_id:
            continue
        cuts = [
            (token[:cut], token[cut:]) for cut in range(1, len(token)) if token[:cut] in vocab and token[cut:] in vocab
        ]
        cuts.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        candidates.extend((scores[token_id], len(left), len(right), left, right) for left, right in cuts)
    # Stable sort: equal keys keep the vocabulary order, as in the reference.
    candidates.sort(key=lambda c: (-c[0], -c[1], -c[2]))
    return [(left, right) for _, _, _, left, right in candidates]
