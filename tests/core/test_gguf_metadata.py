"""GGUF metadata read as Python values (``tokenmill.gguf_metadata``)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType

from tokenmill.gguf_metadata import GGUFError, GGUFMetadata, has_gguf_magic


def _write(path: Path, metadata: dict[str, tuple[object, GGUFValueType]]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, value_type) in metadata.items():
        writer.add_key_value(key, value, value_type)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_values_as_python(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "m.gguf",
        {
            "a.eps": (1e-5, GGUFValueType.FLOAT32),
            "a.count": (7, GGUFValueType.UINT32),
            "a.flag": (True, GGUFValueType.BOOL),
            "a.name": ("café", GGUFValueType.STRING),
            "a.counts": ([1, 2, 3], GGUFValueType.ARRAY),
            "a.words": (["x", "é"], GGUFValueType.ARRAY),
            "b.scores": ([0.1, -2.5], GGUFValueType.ARRAY),
        },
    )
    metadata = GGUFMetadata.open(path)
    assert metadata.get("general.architecture") == "llama"
    assert metadata.get("a.eps") == 1e-5  # float32 scalars read as written, not 9.999999747378752e-06
    assert metadata.get("a.count") == 7 and metadata.get("a.flag") is True
    assert metadata.get("a.name") == "café"
    assert metadata.get("a.counts") == [1, 2, 3] and metadata.get("a.words") == ["x", "é"]
    assert metadata.get("b.scores") == [float(np.float32(0.1)), -2.5]  # bulk float32 arrays: exact values
    assert metadata.get("missing", 3) == 3 and "missing" not in metadata and "a.eps" in metadata
    assert metadata.num_items("a.words") == 2 and metadata.num_items("a.count") is None
    assert metadata.with_prefix("a.c") == {"a.count": 7, "a.counts": [1, 2, 3]}


def test_unreadable_files_name_the_file(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n" * 10)
    assert not has_gguf_magic(text) and not has_gguf_magic(tmp_path) and not has_gguf_magic(tmp_path / "missing")
    with pytest.raises(GGUFError, match=r"notes\.gguf: not a GGUF file") as info:
        GGUFMetadata.open(text)
    assert "\n" not in str(info.value) and info.value.path == text

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    assert has_gguf_magic(broken)
    with pytest.raises(GGUFError, match=r"broken\.gguf: truncated or corrupt GGUF file"):
        GGUFMetadata.open(broken)


def test_malformed_value_names_the_key(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", {"a.name": ("abc", GGUFValueType.STRING)})
    data = path.read_bytes()
    path.write_bytes(data.replace(b"abc", b"\xff\xfe\xfd", 1))  # not UTF-8
    with pytest.raises(GGUFError, match=r"m\.gguf: metadata key 'a\.name' is unreadable: UnicodeDecodeError"):
        GGUFMetadata.open(path).get("a.name")


def test_the_header_parser_reads_what_gguf_wrote_and_refuses_corruption(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", {"a.count": (7, GGUFValueType.UINT32)})
    metadata = GGUFMetadata.open(path)
    reader = gguf.GGUFReader(path, "r")  # the reference: gguf's own parser
    (info,) = metadata.tensors.values()
    (tensor,) = reader.tensors
    assert (info.name, list(info.shape), info.tensor_type, info.offset) == (
        tensor.name, [int(d) for d in tensor.shape], tensor.tensor_type, int(tensor.data_offset) - reader.data_offset,
    )  # fmt: skip
    data = bytearray(path.read_bytes())
    where = data.index(b"token_embd.weight") + len(b"token_embd.weight")
    data[where : where + 4] = (1 << 31).to_bytes(4, "little")  # an absurd number of dimensions
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"truncated or corrupt GGUF file: ValueError: tensor 'token_embd.weight' has"):
        GGUFMetadata.open(path)
