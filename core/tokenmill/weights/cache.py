"""A cache of loaded models' weights: a warm start reads what a quantizer made, instead of making it again.

A quantizer repacks every linear weight of a checkpoint into its kernels' layout at load, which
takes seconds. After such a load, the model's ``state_dict`` (the packed weights, and the float
tensors beside them) is written to one safetensors file; the next load of the same checkpoint,
through the same code, reads it back as it was written.

An entry is named by :func:`cache_key`, a hash of what the stored tensors depend on: the model's
files (path, size, modification time), the weight format, the model and quantizer classes, the
dtype and device type, the torch and tokenmill versions, and the sizes and modification times of the source files
of the packages those classes come from (a source checkout changes without a version bump). KV
cache and scheduling settings are not in it: they do not change weights. Dense models are not
cached: their checkpoint loads at the speed of reading it already.

Entries are written to a temporary file and renamed, so a reader sees a whole entry or none;
one that does not load or does not fit the model is ignored and rewritten. Writing an entry
removes those whose model files are gone or changed, and keeps the two most recently used of
each model (two installs sharing a cache keep theirs). ``TOKENMILL_WEIGHT_CACHE=0`` turns the
cache off; ``TOKENMILL_WEIGHT_CACHE_DIR`` moves it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from tokenmill import __version__, envs
from tokenmill.layers.linear import Linear
from tokenmill.models.base import CausalLM
from tokenmill.weights.format import WeightFormat

logger = logging.getLogger(__name__)

#: Bumped when what an entry holds or how it is named changes.
_ENTRY_VERSION = "1"
#: Entries kept per model: two installs (say, two tokenmill versions) sharing a cache keep one each.
_MAX_ENTRIES_PER_MODEL = 2
#: Packages whose version is in the key already, or that never change under a running install.
_VERSIONED_PACKAGES = frozenset({"torch", *sys.stdlib_module_names})


def weight_cache_directory() -> Path | None:
    """The cache's directory, or None when ``TOKENMILL_WEIGHT_CACHE`` turns it off."""
    if not envs.TOKENMILL_WEIGHT_CACHE.get():
        return None
    directory = envs.TOKENMILL_WEIGHT_CACHE_DIR.get() or envs.TOKENMILL_CACHE_DIR.get() / "weights"
    return directory.expanduser()


def load_model_weights(
    model: CausalLM,
    path: Path,
    weight_format: WeightFormat,
    dtype: torch.dtype,
    device: torch.device,
    shard: tuple[int, int] = (0, 1),
    expert_parallel: bool = False,
) -> None:
    """Fill ``model`` (materialised, empty) with the weights of ``path``: from the cache when it holds
    them, else from the checkpoint, then caching them. Called once per model load, by the loader.

    :param shard: (rank, size) of a tensor-parallel shard: each shard's weights are an entry of their own.
    :param expert_parallel: the shard holds whole experts (another entry than the shard of every expert).
    """
    directory = weight_cache_directory()
    if directory is None or not _is_repacked(model):
        model.load_weights(weight_format.iter_tensors(path))
        return
    sources = model_file_stats(path)
    key = cache_key(sources, weight_format, model, dtype, device, shard, expert_parallel)
    entry = directory / f"{path.stem}-{key[:16]}.safetensors"
    if entry.exists() and _load_entry(model, entry, key, device):
        return
    model.load_weights(weight_format.iter_tensors(path))
    _save_entry(model, entry, key, sources, shard)


def cache_key(
    sources: dict[str, tuple[int, int]],
    weight_format: WeightFormat,
    model: CausalLM,
    dtype: torch.dtype,
    device: torch.device,
    shard: tuple[int, int] = (0, 1),
    expert_parallel: bool = False,
) -> str:
    """The hash naming the entry for ``model`` loaded from ``sources`` (path -> size and modification time),
    or for tensor-parallel shard ``(rank, size)`` of it (holding whole experts: ``expert_parallel``)."""
    quantizers = {type(module.quantizer) for module in model.modules() if isinstance(module, Linear)}
    classes: list[type] = [type(model), type(weight_format), *sorted(quantizers, key=_name)]
    parts: dict[str, Any] = {
        "entry": _ENTRY_VERSION,
        "sources": sorted(sources.items()),
        "weight_format": weight_format.name,
        "classes": [_name(c) for c in classes],
        "dtype": str(dtype),
        "device": device.type,
        "tokenmill": __version__,
        "torch": torch.__version__,
        "code": _code_fingerprint(classes),
    }
    if shard[1] > 1:  # an unsharded model's key is what it was before tensor parallelism
        parts["shard"] = list(shard)
    if expert_parallel and shard[1] > 1:
        parts["expert_parallel"] = True
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _is_repacked(model: nn.Module) -> bool:
    """Whether a quantizer stores some linear in a layout of its own, which is what is worth caching."""
    return any(isinstance(module, Linear) and not module.quantizer.is_dense for module in model.modules())


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def model_file_stats(path: Path) -> dict[str, tuple[int, int]]:
    """Every file of the model at ``path`` (a file, or a checkpoint directory), with its size and mtime."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {str(f.resolve()): (stat.st_size, stat.st_mtime_ns) for f in files for stat in [f.stat()]}


def _code_fingerprint(classes: Iterable[type]) -> list[tuple[str, int, int]]:
    """Size and mtime of each Python file of the packages that define ``classes`` or that their modules
    import (a quantizer's layout may live in a kernels package), except torch's and the standard library's."""
    packages: set[str] = set()
    for cls in classes:
        module = sys.modules[cls.__module__]
        packages.add(cls.__module__.partition(".")[0])
        for value in vars(module).values():
            name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
            if isinstance(name, str):
                packages.add(name.partition(".")[0])
    fingerprint = []
    for package in sorted(packages - _VERSIONED_PACKAGES):
        source = getattr(sys.modules.get(package), "__file__", None)
        if source is None:
            continue  # not imported, a namespace package or a builtin: nothing to stat
        root = Path(source).parent
        files = sorted(root.rglob("*.py")) if Path(source).name == "__init__.py" else [Path(source)]
        for file in files:
            try:
                stat = file.stat()
            except OSError:  # removed since the listing: an edit in progress
                continue
            fingerprint.append((f"{package}/{file.relative_to(root)}", stat.st_size, stat.st_mtime_ns))
    return fingerprint


def _load_entry(model: nn.Module, entry: Path, key: str, device: torch.device) -> bool:
    """Put the entry's tensors into ``model``; False (model untouched) when it does not load or fit."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    started = time.monotonic()
    try:
        with safe_open(entry, framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(entry, device=str(device))
    except Exception as exc:  # a truncated or foreign file: any failure means "rebuild it"
        logger.warning(
            "ignoring weight cache entry %s (%s: %s); loading the checkpoint", entry, type(exc).__name__, exc
        )
        return False
    problem = "it was written for another key" if metadata.get("key") != key else _misfit(model, tensors)
    if problem is not None:
        logger.warning("ignoring weight cache entry %s: %s; loading the checkpoint", entry, problem)
        return False
    for name, tensor in tensors.items():
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        old = getattr(module, attribute)
        # Assigned, not copied: a quantizer's placeholders are empty until a weight arrives.
        setattr(module, attribute, nn.Parameter(tensor, old.requires_grad) if isinstance(old, nn.Parameter) else tensor)
    os.utime(entry)  # most recently used, for pruning
    logger.info("loaded the repacked weights from %s in %.2f s", entry, time.monotonic() - started)
    return True


def _misfit(model: nn.Module, tensors: dict[str, torch.Tensor]) -> str | None:
    """Why ``tensors`` cannot be ``model``'s state, or None when they can."""
    expected = model.state_dict()
    if expected.keys() != tensors.keys():
        differing = sorted(expected.keys() ^ tensors.keys())
        return (
            f"its tensors differ from the model's ({', '.join(differing[:3])}{', ...' if len(differing) > 3 else ''})"
        )
    for name, tensor in expected.items():
        cached = tensors[name]
        # An empty tensor is a quantizer's placeholder, whose shape comes with its weight.
        if tensor.numel() and (tensor.shape, tensor.dtype) != (cached.shape, cached.dtype):
            return f"tensor {name!r} is {cached.dtype} {list(cached.shape)}, not {tensor.dtype} {list(tensor.shape)}"
    return None


def _save_entry(
    model: nn.Module, entry: Path, key: str, sources: dict[str, tuple[int, int]], shard: tuple[int, int]
) -> None:
    """Write ``model``'s state as ``entry``, atomically; a failure costs the next start a repack, nothing more."""
    from safetensors.torch import save_file

    state = {name: tensor.detach().cpu().contiguous() for name, tensor in model.state_dict().items()}
    storages = [t.untyped_storage().data_ptr() for t in state.values() if t.numel()]
    if len(storages) != len(set(storages)):
        logger.debug("not caching weights: the model shares tensors between parameters")
        return
    partial = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    started = time.monotonic()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        metadata = {"key": key, "sources": json.dumps(sources), "shard": json.dumps(list(shard))}
        save_file(state, partial, metadata=metadata)
        partial.replace(entry)
    except (OSError, RuntimeError) as exc:
        partial.unlink(missing_ok=True)
        logger.warning("could not cache the repacked weights in %s: %s", entry.parent, exc)
        return
    logger.info("cached the repacked weights in %s (%.1f s) for the next start", entry, time.monotonic() - started)
    _prune(entry.parent, keep=entry)


def _prune(directory: Path, keep: Path) -> None:
    """Remove entries whose model files are gone or changed, and all but the most recently used
    ``_MAX_ENTRIES_PER_MODEL`` of each model (each tensor-parallel shard of a model counting as a model)."""
    from safetensors import safe_open

    by_model: dict[str, list[tuple[float, Path]]] = {}
    for entry in directory.glob("*.safetensors"):
        try:
            with safe_open(entry, framework="pt") as f:
                metadata = f.metadata() or {}
            sources = json.loads(metadata["sources"])
            shard = metadata.get("shard", "[0, 1]")
            is_stale = sources != _current(sources)
            used = entry.stat().st_mtime
        except Exception:  # unreadable, or not ours: leave it alone
            continue
        if is_stale and entry != keep:
            entry.unlink(missing_ok=True)
        else:
            by_model.setdefault(json.dumps([sorted(sources), shard]), []).append((used, entry))
    for entries in by_model.values():
        for _, entry in sorted(entries, reverse=True)[_MAX_ENTRIES_PER_MODEL:]:
            if entry != keep:
                entry.unlink(missing_ok=True)


def _current(sources: dict[str, list[int]]) -> dict[str, list[int]]:
    """``sources`` as the files are now: path -> [size, mtime]; missing files are left out."""
    current = {}
    for file in sources:
        try:
            stat = os.stat(file)
        except OSError:
            continue
        current[file] = [stat.st_size, stat.st_mtime_ns]
    return current
