"""Hugging Face model directories: ``config.json`` plus one or more ``*.safetensors`` files.

Layouts accepted, in this order of preference:

1. ``model.safetensors.index.json`` with its ``weight_map`` (sharded checkpoints);
2. a single ``model.safetensors``;
3. every ``*.safetensors`` file in the directory, when there is no index.

Tensors are read one at a time through ``safetensors.safe_open`` (a memory
map), in their stored dtype, so a shard is never loaded whole.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from tokenmill.weights.format import LoadedTensor, WeightsError

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _one_line(text: object) -> str:
    """Collapse an underlying library's message so that ours stays on one line."""
    return " ".join(str(text).split())


def _error(file: Path, problem: str, tensor: str | None = None) -> WeightsError:
    where = f"{file}: tensor {tensor!r}" if tensor is not None else str(file)
    return WeightsError(f"{where}: {_one_line(problem)}")


def _read_json(file: Path) -> Any:
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _error(file, "file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _error(file, f"cannot read: {exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _error(file, f"invalid JSON: {exc}") from exc


class SafetensorsFormat:
    """Reads a Hugging Face model directory with safetensors weights."""

    name: ClassVar[str] = "safetensors"

    def can_load(self, path: Path) -> bool:
        path = Path(path)
        if not path.is_dir() or not (path / CONFIG_FILE).is_file():
            return False
        return (path / INDEX_FILE).is_file() or any(path.glob("*.safetensors"))

    def read_config(self, path: Path) -> dict[str, Any]:
        file = Path(path) / CONFIG_FILE
        config = _read_json(file)
        if not isinstance(config, dict):
            raise _error(file, f"expected a JSON object, got {type(config).__name__}")
        return config

    def iter_tensors(self, path: Path) -> Iterator[LoadedTensor]:
        # Everything that can be checked from headers is checked before the first
        # tensor is read, so a broken checkpoint fails fast instead of half-loaded.
        shards = self._shards_with_names(Path(path))
        for file, names in shards.items():
            yield from self._stream_shard(file, names)

    # ------------------------------------------------------------------ helpers

    def _shard_files(self, directory: Path) -> tuple[list[Path], dict[Path, list[str]] | None]:
        """The shard files to read, and the tensor names the index assigns to each (None: no index)."""
        index_file = directory / INDEX_FILE
        if index_file.is_file():
            index = _read_json(index_file)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise _error(index_file, "has no 'weight_map' object naming the shard of each tensor")
            expected: dict[Path, list[str]] = {}
            for tensor_name, shard in weight_map.items():
                if not isinstance(shard, str) or Path(shard).name != shard:
                    raise _error(index_file, f"bad shard file name {shard!r}", tensor_name)
                expected.setdefault(directory / shard, []).append(tensor_name)
            files = sorted(expected)
            for file in files:
                if not file.is_file():
                    raise _error(file, f"missing shard (listed in {INDEX_FILE})")
            return files, expected
        if (directory / SINGLE_FILE).is_file():
            return [directory / SINGLE_FILE], None
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise _error(directory, f"no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file")
        return files, None

    def _shards_with_names(self, directory: Path) -> dict[Path, list[str]]:
        """Open every shard's header once and return each shard's tensor names, in stored order."""
        from safetensors import SafetensorError, safe_open

        files, expected = self._shard_files(directory)
        owner: dict[str, Path] = {}
        shards: dict[Path, list[str]] = {}
        for file in files:
            try:
                with safe_open(file, framework="pt") as handle:
                    names = list(handle.keys())
            except SafetensorError as exc:
                raise _error(file, f"corrupt or truncated safetensors file: {exc}") from exc
            except OSError as exc:
                raise _error(file, f"cannot read: {exc}") from exc
            if expected is not None:
                present = set(names)
                for tensor_name in expected[file]:
                    if tensor_name not in present:
                        raise _error(file, f"not in this shard although {INDEX_FILE} says so", tensor_name)
            for tensor_name in names:
                if tensor_name in owner:
                    raise _error(file, f"also stored in {owner[tensor_name]}", tensor_name)
                owner[tensor_name] = file
            shards[file] = names
        logger.debug("%s: %d tensors in %d file(s)", directory, len(owner), len(shards))
        return shards

    def _stream_shard(self, file: Path, names: list[str]) -> Iterator[LoadedTensor]:
        from safetensors import SafetensorError, safe_open

        try:
            handle_context = safe_open(file, framework="pt")
        except (SafetensorError, OSError) as exc:  # changed since the header check
            raise _error(file, f"corrupt or truncated safetensors file: {exc}") from exc
        with handle_context as handle:
            for tensor_name in names:
                try:
                    tensor = handle.get_tensor(tensor_name)
                except (SafetensorError, OSError, RuntimeError) as exc:
                    raise _error(file, f"cannot read tensor data: {exc}", tensor_name) from exc
                yield LoadedTensor(tensor_name, tensor, file)
