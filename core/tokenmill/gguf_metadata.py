"""A GGUF file's key/value metadata as Python values: the one place that reads it.

GGUF (llama.cpp's single-file format) keeps the model's config, its
tokenizer and its tensor index in a header. The weight format
(``weights.gguf_format``) and the tokenizer (``tokenizer.gguf_tokenizer``)
both read that header through this module, so a field is decoded the same
way wherever it is used, and a bad file fails with the same message.

``gguf`` is imported only when a file is opened: importing this module is cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.errors import TokenmillError

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderField

__all__ = ["GGUF_MAGIC", "GGUFError", "GGUFMetadata", "field_value", "has_gguf_magic", "open_gguf"]

GGUF_MAGIC = b"GGUF"


class GGUFError(TokenmillError, ValueError):
    """A GGUF file cannot be read. ``str()`` names the file; ``reason`` is the one-line problem alone."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = " ".join(reason.split())
        super().__init__(f"{path}: {self.reason}")


def has_gguf_magic(path: Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic; False for a directory or an unreadable path."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def open_gguf(path: Path) -> GGUFReader:
    """Parse ``path``'s header with ``gguf.GGUFReader`` (memory-mapped, read-only).

    Called once per file load by the weight format and by the tokenizer. Raises
    ``GGUFError`` ("not a GGUF file" or "truncated or corrupt GGUF file", with
    the parser's reason) when the header does not parse.
    """
    from gguf import GGUFReader

    try:
        return GGUFReader(path, "r")
    except Exception as exc:  # a third-party parser on untrusted bytes: any failure means "corrupt"
        problem = "truncated or corrupt GGUF file" if has_gguf_magic(path) else "not a GGUF file"
        raise GGUFError(path, f"{problem}: {type(exc).__name__}: {exc}") from exc


def field_value(field: ReaderField) -> Any:
    """One metadata field as Python: str, int, float, bool, or a list of those.

    A float32 scalar becomes its shortest decimal (``1e-05``, not
    ``9.999999747378752e-06``), so that config values read as written.
    Arrays are bulk data (token lists, scores): numeric ones are converted in
    one go, exactly. An array of arrays is None: no key we read has one.
    Raises ``UnicodeDecodeError``, ``IndexError`` or ``ValueError`` on malformed data.
    """
    import numpy as np
    from gguf import GGUFValueType

    value_type = field.types[0]
    if value_type == GGUFValueType.ARRAY:
        if not field.data:
            return []
        item_type = field.types[-1] if len(field.types) > 1 else None
        if item_type == GGUFValueType.STRING:
            return [bytes(field.parts[index]).decode("utf-8") for index in field.data]
        if item_type == GGUFValueType.ARRAY:
            return None
        return np.concatenate([field.parts[index] for index in field.data]).tolist()
    part = field.parts[field.data[0]]
    if value_type == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if value_type == GGUFValueType.FLOAT32:
        return float(str(np.float32(part[0])))
    return part[0].item()


class GGUFMetadata:
    """The key/value fields of one opened GGUF file, each decoded when it is asked for.

    Decoding on access matters: a tokenizer's token list is ~100k strings, and
    reading a config needs none of them.
    """

    def __init__(self, path: Path, reader: GGUFReader) -> None:
        self.path = path
        self.reader = reader

    @classmethod
    def open(cls, path: Path) -> GGUFMetadata:
        """Open ``path`` (``open_gguf``) and wrap its fields; raises ``GGUFError``."""
        path = Path(path)
        return cls(path, open_gguf(path))

    def __contains__(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        """``key``'s value (``field_value``), or ``default`` when absent; raises ``GGUFError`` when malformed."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field_value(field)
        except (UnicodeDecodeError, IndexError, ValueError) as exc:
            raise GGUFError(self.path, f"metadata key {key!r} is unreadable: {type(exc).__name__}: {exc}") from exc

    def num_items(self, key: str) -> int | None:
        """How many items the array ``key`` holds, without decoding them; None when absent or not an array."""
        from gguf import GGUFValueType

        field = self.reader.fields.get(key)
        if field is None or not field.types or field.types[0] != GGUFValueType.ARRAY:
            return None
        return len(field.data)

    def with_prefix(self, prefix: str) -> dict[str, Any]:
        """Every key that starts with ``prefix``, decoded (``{"tokenizer.ggml.model": "gpt2", ...}``)."""
        return {key: self.get(key) for key in self.reader.fields if key.startswith(prefix)}
