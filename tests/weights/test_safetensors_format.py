"""SafetensorsFormat against checkpoints written by transformers' save_pretrained."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import safetensors
import torch

from tests.factories import make_hf_model
from tokenmill.weights import LoadedTensor, SafetensorsFormat, WeightsError

transformers = pytest.importorskip("transformers")

INDEX = "model.safetensors.index.json"


def _tiny_llama(dtype: torch.dtype) -> torch.nn.Module:
    return make_hf_model("llama-tiny").to(dtype)


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> dict[torch.dtype, tuple[Path, dict]]:
    """A sharded save of the tiny Llama in each dtype, with its state_dict."""
    saved = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        model = _tiny_llama(dtype)
        directory = tmp_path_factory.mktemp(f"llama-{str(dtype).split('.')[-1]}")
        model.save_pretrained(directory, max_shard_size="100KB")
        saved[dtype] = (directory, {k: v.clone() for k, v in model.state_dict().items()})
    return saved


@pytest.fixture
def sharded(saved_models: dict, tmp_path: Path) -> tuple[Path, dict]:
    """A private copy of the fp32 sharded checkpoint that a test may damage."""
    source, state_dict = saved_models[torch.float32]
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target, state_dict


def _shards(directory: Path) -> list[Path]:
    weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
    return [directory / name for name in sorted(set(weight_map.values()))]


def _assert_one_line_error(excinfo: pytest.ExceptionInfo[WeightsError], file: Path) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith(str(file) + ":"), message
    return message


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_sharded_checkpoint_matches_state_dict(saved_models: dict, dtype: torch.dtype) -> None:
    directory, state_dict = saved_models[dtype]
    assert len(_shards(directory)) > 1, "the checkpoint should be sharded"
    loaded = {t.name: t for t in SafetensorsFormat().iter_tensors(directory)}
    assert sorted(loaded) == sorted(state_dict)
    for name, expected in state_dict.items():
        tensor = loaded[name].tensor
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor, expected), name
        assert loaded[name].file.parent == directory


def test_read_config_is_config_json(saved_models: dict) -> None:
    directory, _ = saved_models[torch.float32]
    config = SafetensorsFormat().read_config(directory)
    assert config == json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == 64


def test_single_file_and_unindexed_shards(saved_models: dict, tmp_path: Path) -> None:
    _, state_dict = saved_models[torch.float32]
    single = tmp_path / "single"
    _tiny_llama(torch.float32).save_pretrained(single)
    assert (single / "model.safetensors").is_file()
    names = [t.name for t in SafetensorsFormat().iter_tensors(single)]
    assert sorted(names) == sorted(state_dict)

    unindexed = tmp_path / "unindexed"
    shutil.copytree(saved_models[torch.float32][0], unindexed)
    (unindexed / INDEX).unlink()
    loaded = {t.name: t.tensor for t in SafetensorsFormat().iter_tensors(unindexed)}
    assert sorted(loaded) == sorted(state_dict)
    assert all(torch.equal(loaded[name], state_dict[name]) for name in state_dict)


def test_streams_one_tensor_at_a_time(sharded: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch) -> None:
    directory, state_dict = sharded
    reads: list[str] = []
    real_safe_open = safetensors.safe_open

    class CountingHandle:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self._context = real_safe_open(*args, **kwargs)

        def __enter__(self) -> CountingHandle:
            self._handle = self._context.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self._context.__exit__(*exc)

        def keys(self) -> list[str]:
            return self._handle.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            reads.append(name)
            return self._handle.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", CountingHandle)
    tensors = SafetensorsFormat().iter_tensors(directory)
    first = next(tensors)
    assert reads == [first.name]
    assert isinstance(first, LoadedTensor)
    assert len(list(tensors)) == len(state_dict) - 1
    assert len(reads) == len(state_dict)


def test_can_load(sharded: tuple[Path, dict], tmp_path: Path) -> None:
    directory, _ = sharded
    fmt = SafetensorsFormat()
    assert fmt.can_load(directory)
    assert not fmt.can_load(_shards(directory)[0])  # a file, not a model directory
    assert not fmt.can_load(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert not fmt.can_load(empty)


def test_missing_shard_fails_before_any_tensor(sharded: tuple[Path, dict]) -> None:
    directory, _ = sharded
    missing = _shards(directory)[-1]
    missing.unlink()
    tensors = SafetensorsFormat().iter_tensors(directory)
    with pytest.raises(WeightsError) as excinfo:
        next(tensors)
    message = _assert_one_line_error(excinfo, missing)
    assert "missing shard" in message


def test_truncated_shard(sharded: tuple[Path, dict]) -> None:
    directory, _ = sharded
    shard = _shards(directory)[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(WeightsError) as excinfo:
        next(SafetensorsFormat().iter_tensors(directory))
    message = _assert_one_line_error(excinfo, shard)
    assert "truncated" in message


def test_corrupt_header(sharded: tuple[Path, dict]) -> None:
    directory, _ = sharded
    shard = _shards(directory)[0]
    data = bytearray(shard.read_bytes())
    data[8:16] = b"#garbage"
    shard.write_bytes(bytes(data))
    with pytest.raises(WeightsError) as excinfo:
        list(SafetensorsFormat().iter_tensors(directory))
    message = _assert_one_line_error(excinfo, shard)
    assert "JSON" in message


def test_header_claiming_more_bytes_than_the_file(sharded: tuple[Path, dict]) -> None:
    directory, _ = sharded
    shard = _shards(directory)[0]
    data = shard.read_bytes()
    (header_size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_size])
    name = next(key for key in header if key != "__metadata__")
    header[name]["data_offsets"][1] += 4096  # a tensor past the end of the file
    encoded = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + header_size :])
    with pytest.raises(WeightsError) as excinfo:
        next(SafetensorsFormat().iter_tensors(directory))
    _assert_one_line_error(excinfo, shard)

    shard.write_bytes(struct.pack("<Q", 10**9) + data[8:])  # a header longer than the file
    with pytest.raises(WeightsError) as excinfo:
        next(SafetensorsFormat().iter_tensors(directory))
    _assert_one_line_error(excinfo, shard)


def test_index_naming_a_tensor_absent_from_its_shard(sharded: tuple[Path, dict]) -> None:
    directory, _ = sharded
    index = json.loads((directory / INDEX).read_text())
    first, last = _shards(directory)[0], _shards(directory)[-1]
    moved = next(name for name, shard in index["weight_map"].items() if shard == first.name)
    index["weight_map"][moved] = last.name
    (directory / INDEX).write_text(json.dumps(index))
    with pytest.raises(WeightsError) as excinfo:
        next(SafetensorsFormat().iter_tensors(directory))
    message = _assert_one_line_error(excinfo, last)
    assert repr(moved) in message


@pytest.mark.parametrize("content", ["{not json", None, "[1, 2]"], ids=["bad-json", "missing", "not-object"])
def test_bad_config_json(sharded: tuple[Path, dict], content: str | None) -> None:
    directory, _ = sharded
    config = directory / "config.json"
    if content is None:
        config.unlink()
    else:
        config.write_text(content)
    with pytest.raises(WeightsError) as excinfo:
        SafetensorsFormat().read_config(directory)
    _assert_one_line_error(excinfo, config)


def test_bad_index_json(sharded: tuple[Path, dict]) -> None:
    directory, _ = sharded
    (directory / INDEX).write_text('{"metadata": {}}')
    with pytest.raises(WeightsError) as excinfo:
        next(SafetensorsFormat().iter_tensors(directory))
    message = _assert_one_line_error(excinfo, directory / INDEX)
    assert "weight_map" in message
