"""Reading a tokenizer from a Hugging Face model directory.

The directory holds ``tokenizer.json`` (the whole ``tokenizers`` pipeline) and
usually ``tokenizer_config.json`` (special token names, the chat template).
A ``chat_template.jinja`` file, when present, overrides the config's template,
and ``generation_config.json`` may list more end-of-sequence ids.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import tokenizers

from tokenmill.tokenizer.source import TokenizerSource

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"


def load_hf_tokenizer(model_dir: Path) -> TokenizerSource:
    """Build a ``TokenizerSource`` from a Hugging Face model directory.

    Called once per model load. Raises ``ValueError`` naming the file when
    ``tokenizer.json`` is missing or a file cannot be parsed.

    As in ``transformers`` 5, ``add_bos_token``/``add_eos_token`` in the
    config do not override the post-processor of ``tokenizer.json``: that
    post-processor alone decides which special tokens ``encode`` adds.
    """
    tokenizer_file = model_dir / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise ValueError(f"{tokenizer_file}: not found; a Hugging Face model directory needs a {TOKENIZER_FILE}")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"{tokenizer_file}: cannot be loaded by tokenizers ({_one_line(exc)})") from exc

    config = _read_json(model_dir / CONFIG_FILE)
    template_file = model_dir / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        chat_template: str | None = template_file.read_text(encoding="utf-8")
    else:
        chat_template = _default_template(config.get("chat_template"), model_dir / CONFIG_FILE)

    extra_special = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra_special, dict):  # the named form: {"image_token": "<image>", ...}
        extra_special = list(extra_special.values())
    for flag in ("add_bos_token", "add_eos_token"):
        if flag in config:
            logger.debug(
                "%s: %s=%s is ignored; %s's post-processor decides", CONFIG_FILE, flag, config[flag], TOKENIZER_FILE
            )

    return TokenizerSource(
        path=model_dir,
        backend=backend,
        bos_token=_token_content(config.get("bos_token")),
        eos_token=_token_content(config.get("eos_token")),
        unk_token=_token_content(config.get("unk_token")),
        pad_token=_token_content(config.get("pad_token")),
        extra_special_tokens=tuple(t for t in map(_token_content, extra_special) if t is not None),
        extra_eos_token_ids=_generation_eos_ids(model_dir / GENERATION_CONFIG_FILE),
        chat_template=chat_template,
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({_one_line(exc)})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: Any) -> str | None:
    """A special token is written as a string or as an AddedToken dict with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _default_template(value: Any, config_file: Path) -> str | None:
    """``chat_template`` is a string, or a list of ``{"name", "template"}`` of which we use "default"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {str(item.get("name")): item.get("template") for item in value if isinstance(item, dict)}
        default = named.get("default")
        if isinstance(default, str):
            return default
        logger.warning("%s: chat templates %s have no 'default'; none is used", config_file, sorted(named))
        return None
    raise ValueError(f"{config_file}: chat_template must be a string or a list, got {type(value).__name__}")


def _generation_eos_ids(path: Path) -> tuple[int, ...]:
    eos = _read_json(path).get("eos_token_id")
    if isinstance(eos, int):
        return (eos,)
    if isinstance(eos, list):
        return tuple(token_id for token_id in eos if isinstance(token_id, int))
    return ()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
