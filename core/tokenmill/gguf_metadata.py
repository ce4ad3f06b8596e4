"""A GGUF file's key/value metadata as Python values: the one place that reads it.

GGUF (llama.cpp's single-file format) keeps the model's config, its
tokenizer and its tensor index in a header. The weight format
(``weights.gguf_format``) and the tokenizer (``tokenizer.gguf_tokenizer``)
both read that header through this module, so a field is decoded the same
way wherever it is used, and a bad file fails with the same message.

The header (keys, values, tensor index) is parsed here with ``struct`` in
milliseconds; ``gguf.GGUFReader`` (``open_gguf``) is opened only to read
tensor data. Importing this module is cheap.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.errors import TokenmillError

if TYPE_CHECKING:
    from gguf import GGUFReader

__all__ = ["GGUF_MAGIC", "GGUFError", "GGUFMetadata", "TensorInfo", "has_gguf_magic", "open_gguf"]

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
    """Open ``path`` with ``gguf.GGUFReader`` (memory-mapped, read-only) to read tensor data.

    Called by the weight format when it decodes tensors (a cold load). Raises
    ``GGUFError`` ("not a GGUF file" or "truncated or corrupt GGUF file", with
    the parser's reason) when the header does not parse.
    """
    from gguf import GGUFReader

    try:
        return GGUFReader(path, "r")
    except Exception as exc:  # a third-party parser on untrusted bytes: any failure means "corrupt"
        problem = "truncated or corrupt GGUF file" if has_gguf_magic(path) else "not a GGUF file"
        raise GGUFError(path, f"{problem}: {type(exc).__name__}: {exc}") from exc


# GGUF value types (gguf.GGUFValueType) and how each is stored, little-endian.
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
                 12: "<f8"}  # fmt: skip
_FLOAT32 = 6


@dataclass(frozen=True)
class _Field:
    """Where one value sits in the header, to be decoded when asked for."""

    value_type: int
    offset: int  # of the value (for an array: of its first item)
    item_type: int | None = None  # arrays only
    count: int = 1  # arrays: number of items


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor index: enough to read a config without touching tensor data."""

    name: str
    shape: tuple[int, ...]  # as stored (GGML order: the fastest-varying dimension first), like gguf.ReaderTensor
    type_id: int  # gguf.GGMLQuantizationType value
    offset: int  # of its data, from the start of the data section

    @property
    def tensor_type(self) -> Any:
        """The ``gguf.GGMLQuantizationType`` (``.name`` is e.g. ``"Q4_1"``)."""
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.type_id)


class _Header:
    """A little-endian GGUF v2/v3 header parsed with ``struct``: key/value positions and the tensor index.

    ``gguf.GGUFReader`` builds a numpy view for every item of every array (a tokenizer's ~100k tokens and
    merges), which takes seconds; this walks the header once, skipping over array items, and decodes a
    value only when it is asked for. Tensor data stays with ``GGUFReader`` (``open_gguf``).
    """

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            self.buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.fields: dict[str, _Field] = {}
        self.tensors: dict[str, TensorInfo] = {}
        buffer = self.buffer
        if buffer[:4] != GGUF_MAGIC:
            raise ValueError("no GGUF magic")
        (version,) = struct.unpack_from("<I", buffer, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (or the other byte order) is not supported")
        num_tensors, num_fields = struct.unpack_from("<QQ", buffer, 8)
        position = 24
        for _ in range(num_fields):
            key, position = self._string(position)
            (value_type,) = struct.unpack_from("<I", buffer, position)
            position += 4
            field, position = self._skip(value_type, position)
            self.fields[key] = field
        for _ in range(num_tensors):
            name, position = self._string(position)
            (num_dims,) = struct.unpack_from("<I", buffer, position)
            if num_dims > 4:  # GGML_MAX_DIMS; a corrupt count must not build a huge struct format
                raise ValueError(f"tensor {name!r} has {num_dims} dimensions")
            shape = struct.unpack_from(f"<{num_dims}Q", buffer, position + 4)
            position += 4 + 8 * num_dims
            type_id, offset = struct.unpack_from("<IQ", buffer, position)
            position += 12
            self.tensors[name] = TensorInfo(name, tuple(shape), type_id, offset)
        self._check_tensor_extents(position)

    def _check_tensor_extents(self, end_of_index: int) -> None:
        """Raise when a tensor's data would run past the end of the file (a truncated download)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        alignment_field = self.fields.get("general.alignment")
        alignment = int(self.value(alignment_field)) if alignment_field is not None else 32
        if alignment <= 0:
            raise ValueError(f"general.alignment is {alignment}")
        data_start = -(-end_of_index // alignment) * alignment
        for tensor in self.tensors.values():
            try:
                block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.type_id)]
            except (ValueError, KeyError):
                continue  # an unknown type: reading the tensor will name it
            num_elements = 1
            for dim in tensor.shape:
                num_elements *= dim
            end = data_start + tensor.offset + num_elements // block_size * type_size
            if end > len(self.buffer):
                raise ValueError(f"tensor {tensor.name!r} runs past the end of the file ({end} > {len(self.buffer)})")

    def _string(self, position: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self.buffer, position)
        end = position + 8 + length
        if end > len(self.buffer):
            raise ValueError(f"a string at byte {position} runs past the end of the file")
        return bytes(self.buffer[position + 8 : end]).decode("utf-8"), end

    def _skip(self, value_type: int, position: int) -> tuple[_Field, int]:
        """The field starting at ``position`` (after its type) and where the next one starts."""
        if value_type in _SCALAR_FORMATS:
            return _Field(value_type, position), position + struct.calcsize(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            (length,) = struct.unpack_from("<Q", self.buffer, position)
            return _Field(value_type, position), position + 8 + length
        if value_type != _ARRAY:
            raise ValueError(f"unknown value type {value_type} at byte {position}")
        item_type, count = struct.unpack_from("<IQ", self.buffer, position)
        start = end = position + 12
        if item_type in _SCALAR_FORMATS:
            end += count * struct.calcsize(_SCALAR_FORMATS[item_type])
        elif item_type == _STRING:  # a tokenizer's tokens and merges: ~100k strings, walked without a call each
            unpack_length = struct.Struct("<Q").unpack_from
            for _ in range(count):
                end += 8 + unpack_length(self.buffer, end)[0]
        else:
            for _ in range(count):  # strings and nested arrays have their own lengths
                end = self._skip(item_type, end)[1]
        if end > len(self.buffer):
            raise ValueError(f"an array at byte {position} runs past the end of the file")
        return _Field(value_type, start, item_type, count), end

    def value(self, field: _Field) -> Any:
        """One field as Python: str, int, float, bool, or a list of those (None for an array of arrays).

        A float32 scalar becomes its shortest decimal (``1e-05``, not ``9.999999747378752e-06``), so that
        config values read as written; numeric arrays are converted in one go, exactly. Raises
        ``UnicodeDecodeError``, ``struct.error`` or ``ValueError`` on malformed data.
        """
        import numpy as np

        buffer = self.buffer
        if field.value_type == _STRING:
            return self._string(field.offset)[0]
        if field.value_type != _ARRAY:
            (value,) = struct.unpack_from(_SCALAR_FORMATS[field.value_type], buffer, field.offset)
            return float(str(np.float32(value))) if field.value_type == _FLOAT32 else value
        if field.item_type == _STRING:
            items, position = [], field.offset
            for _ in range(field.count):
                item, position = self._string(position)
                items.append(item)
            return items
        if field.item_type not in _NUMPY_DTYPES:
            return None  # an array of arrays: no key we read has one
        dtype = np.dtype(_NUMPY_DTYPES[field.item_type])
        return np.frombuffer(buffer, dtype=dtype, count=field.count, offset=field.offset).tolist()


class GGUFMetadata:
    """The key/value fields and the tensor index of one GGUF file, each value decoded when it is asked for.

    Decoding on access matters: a tokenizer's token list is ~100k strings, and reading a config needs none
    of them.
    """

    def __init__(self, path: Path, header: _Header) -> None:
        self.path = path
        self._header = header

    @classmethod
    def open(cls, path: Path) -> GGUFMetadata:
        """Parse ``path``'s header; raises ``GGUFError`` ("not a GGUF file" or "truncated or corrupt GGUF
        file", with the reason) when it does not parse."""
        path = Path(path)
        try:
            return cls(path, _Header(path))
        except (OSError, ValueError, struct.error, UnicodeDecodeError, OverflowError) as exc:
            problem = "truncated or corrupt GGUF file" if has_gguf_magic(path) else "not a GGUF file"
            raise GGUFError(path, f"{problem}: {type(exc).__name__}: {exc}") from exc

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """The tensor index, by name, in file order."""
        return self._header.tensors

    def __contains__(self, key: str) -> bool:
        return key in self._header.fields

    def get(self, key: str, default: Any = None) -> Any:
        """``key``'s value, or ``default`` when absent; raises ``GGUFError`` when malformed."""
        field = self._header.fields.get(key)
        if field is None:
            return default
        try:
            return self._header.value(field)
        except (UnicodeDecodeError, ValueError, struct.error) as exc:
            raise GGUFError(self.path, f"metadata key {key!r} is unreadable: {type(exc).__name__}: {exc}") from exc

    def num_items(self, key: str) -> int | None:
        """How many items the array ``key`` holds, without decoding them; None when absent or not an array."""
        field = self._header.fields.get(key)
        return field.count if field is not None and field.value_type == _ARRAY else None

    def with_prefix(self, prefix: str) -> dict[str, Any]:
        """Every key that starts with ``prefix``, decoded (``{"tokenizer.ggml.model": "gpt2", ...}``)."""
        return {key: self.get(key) for key in self._header.fields if key.startswith(prefix)}
