"""The weight cache (``tokenmill.weights.cache``): a warm load reads back exactly what a cold load repacked."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from tokenmill_plugins.quant.weight_only import Int4Quantizer, Int8Quantizer

from tests.factories import make_hf_model, save_hf_model
from tests.weights.gguf_util import write_llama_gguf
from tokenmill.config import load_config
from tokenmill.model_loader import LoadedModel, load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk

pytestmark = pytest.mark.skipif(not Int8Quantizer.is_available(), reason="the kernels need AVX2, FMA and a compiler")

PROMPT = [(7 * t + 3) % 500 + 1 for t in range(24)]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "weight-cache"
    monkeypatch.setenv("TOKENMILL_WEIGHT_CACHE_DIR", str(directory))
    monkeypatch.delenv("TOKENMILL_WEIGHT_CACHE", raising=False)
    return directory


@pytest.fixture
def q4_1_gguf(tmp_path: Path) -> Path:
    """A tiny Llama in a Q4_1 GGUF, as the default model is: ``auto`` loads it through ``int4``."""
    model = make_hf_model("llama-tiny")
    return write_llama_gguf(model, model.config, tmp_path / "tiny.Q4_1.gguf", qtype=QType.Q4_1)


def _load(model: Path, **model_settings: str) -> LoadedModel:
    return load_model(load_config(overrides={"model": {"model": str(model), **model_settings}}))


def _logits(loaded: LoadedModel) -> torch.Tensor:
    """Logits of every prompt position, then of two decode steps."""
    runner = ModelRunner(loaded, num_blocks=4, block_size=16)
    blocks = [0, 1, 2, 3]
    prompt = runner.execute([SequenceChunk(PROMPT, 0, blocks)], all_logits=True)
    decode = [runner.execute([SequenceChunk([t], len(PROMPT) + i, blocks)]) for i, t in enumerate((11, 12))]
    return torch.cat([prompt, *decode])


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def _refuse_to_quantize(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: object, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise AssertionError("a warm load quantized a weight")

    for quantizer_class in (Int4Quantizer, Int8Quantizer):
        monkeypatch.setattr(quantizer_class, "quantize", refuse)


def test_a_warm_load_gives_the_cold_loads_logits_bit_for_bit(
    cache_dir: Path, q4_1_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cold = _load(q4_1_gguf)
    assert cold.model.model.layers[0].mlp.down_proj.quantizer.name == "int4"
    (entry,) = _entries(cache_dir)
    assert entry.name.startswith("tiny.Q4_1-")
    with monkeypatch.context() as patch:
        _refuse_to_quantize(patch)
        warm = _load(q4_1_gguf)
    for name, tensor in cold.model.state_dict().items():
        cached = warm.model.state_dict()[name]
        assert (cached.dtype, cached.shape) == (tensor.dtype, tensor.shape) and torch.equal(cached, tensor), name
    assert all(not p.requires_grad for p in warm.model.parameters())
    assert torch.equal(_logits(warm), _logits(cold))
    assert _entries(cache_dir) == [entry]


def test_a_float_checkpoint_quantized_at_load_is_cached_too(cache_dir: Path, tmp_path: Path) -> None:
    save_hf_model("llama-tied", tmp_path / "float")
    cold = _load(tmp_path / "float", quantization="int8")
    assert len(_entries(cache_dir)) == 1
    warm = _load(tmp_path / "float", quantization="int8")
    assert torch.equal(_logits(warm), _logits(cold))
    _load(tmp_path / "float", quantization="int4")  # another quantizer: another entry
    assert len(_entries(cache_dir)) == 2


def test_dense_models_and_a_disabled_cache_write_nothing(
    cache_dir: Path, q4_1_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_hf_model("llama-tiny", tmp_path / "float")
    _load(tmp_path / "float")  # auto keeps a float checkpoint dense: it loads at disk speed already
    assert not cache_dir.exists()
    monkeypatch.setenv("TOKENMILL_WEIGHT_CACHE", "0")
    _load(q4_1_gguf)
    assert not cache_dir.exists()


def test_a_broken_entry_is_ignored_and_rewritten(
    cache_dir: Path, q4_1_gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    expected = _logits(_load(q4_1_gguf))
    (entry,) = _entries(cache_dir)
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # truncated
    with caplog.at_level(logging.WARNING, logger="tokenmill.weights.cache"):
        assert torch.equal(_logits(_load(q4_1_gguf)), expected)
    assert "ignoring weight cache entry" in caplog.text
    assert torch.equal(_logits(_load(q4_1_gguf)), expected)  # from the rewritten entry
    assert _entries(cache_dir) == [entry] and not list(cache_dir.glob(".*.tmp"))


def test_a_changed_model_file_gets_a_new_entry_and_the_stale_one_goes(
    cache_dir: Path, q4_1_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _load(q4_1_gguf)
    (old,) = _entries(cache_dir)
    model = make_hf_model("llama-tiny", seed=1)  # the same name and shape, other weights
    write_llama_gguf(model, model.config, q4_1_gguf, qtype=QType.Q4_1)
    stat = q4_1_gguf.stat()
    os.utime(q4_1_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # whatever the clock's resolution
    with monkeypatch.context() as patch:
        patch.setenv("TOKENMILL_WEIGHT_CACHE", "0")
        expected = _logits(_load(q4_1_gguf))
    assert torch.equal(_logits(_load(q4_1_gguf)), expected)
    (new,) = _entries(cache_dir)
    assert new != old
