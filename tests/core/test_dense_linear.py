"""The ``none`` quantizer's CPU float32 matmuls (the ``cpu`` layer kernels', oneDNN's) against ``F.linear``, and
the packed-weight cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenmill_plugins.layer_kernels.cpu_kernels import CpuLayerKernels

from tests.factories import save_tiny_model
from tokenmill.config import load_config
from tokenmill.layers.dense import DenseQuantizer, _onednn_linear_available
from tokenmill.layers.kernels import TorchLayerKernels
from tokenmill.layers.linear import Linear
from tokenmill.model_loader import load_model

pytestmark = [
    pytest.mark.skipif(not _onednn_linear_available(), reason="this torch has no oneDNN packed linear"),
    pytest.mark.skipif(not CpuLayerKernels.is_available(), reason="needs AVX2+FMA and a C++ toolchain"),
]


def _linear(bias: bool, monkeypatch: pytest.MonkeyPatch, matmul: str = "kernels") -> Linear:
    monkeypatch.setenv("TOKENMILL_DENSE_CPU_MATMUL", matmul)
    layer = Linear(96, 80, bias, DenseQuantizer(), torch.float32)
    layer.layer_kernels = CpuLayerKernels()  # as the loader installs them
    torch.manual_seed(0)
    layer.load_weight("weight", torch.randn(80, 96))
    if bias:
        layer.load_weight("bias", torch.randn(80))
    return layer


@pytest.mark.parametrize("matmul", ["kernels", "onednn"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1,), (5,), (64,), (2, 3)])
def test_matches_f_linear(matmul: str, bias: bool, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _linear(bias, monkeypatch, matmul)
    x = torch.randn(*shape, 96)
    with torch.inference_mode():
        out = layer(x)
    _, kernels, packed = layer.__dict__["_packed_weight"]  # the packed path ran, with the matmul asked for
    assert packed is not None and isinstance(kernels, CpuLayerKernels) == (matmul == "kernels")
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_layer_kernels_without_a_dense_matmul_leave_it_to_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_DENSE_CPU_MATMUL", raising=False)  # the default: the layer kernels' matmul
    layer = _linear(True, monkeypatch)
    layer.layer_kernels = TorchLayerKernels()
    x = torch.randn(3, 96)
    with torch.inference_mode():
        out = layer(x)
    _, kernels, packed = layer.__dict__["_packed_weight"]
    assert kernels is None and packed is not None  # oneDNN's
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_a_weight_changed_in_place_is_packed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AWQ pipeline scales weights between forwards: a stale packed copy would give the old outputs."""
    layer = _linear(False, monkeypatch)
    x = torch.randn(3, 96)
    with torch.inference_mode():
        before = layer(x)
        layer.weight.mul_(2)
        after = layer(x)
    torch.testing.assert_close(after, 2 * before, rtol=1e-5, atol=1e-5)


def test_torch_setting_and_autograd_use_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _linear(True, monkeypatch, matmul="torch")
    x = torch.randn(4, 96)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert "_packed_weight" not in layer.__dict__
    layer = _linear(True, monkeypatch)
    x.requires_grad_(True)
    layer(x).sum().backward()  # the packed matmuls have no backward; inputs that need one take F.linear
    assert x.grad is not None and "_packed_weight" not in layer.__dict__


def test_bad_setting_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_DENSE_CPU_MATMUL", "mkl")
    with pytest.raises(
        ValueError, match="TOKENMILL_DENSE_CPU_MATMUL='mkl' is invalid: expected kernels, onednn or torch"
    ):
        DenseQuantizer()


def test_tied_output_projection_multiplies_by_the_embedding(tmp_path: Path) -> None:
    directory = save_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    model = load_model(load_config(overrides={"model": {"model": str(directory)}, "device": {"device": "cpu"}})).model
    assert model.lm_head is None
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    assert isinstance(
        model.model.embed_tokens.__dict__["_packed_weight"][1], CpuLayerKernels
    )  # installed by the loader
    torch.testing.assert_close(logits, F.linear(hidden, model.model.embed_tokens.weight), rtol=1e-5, atol=1e-5)


def test_no_packed_copy_without_room_for_it(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A model too large for two copies of its weights keeps running, through F.linear, rather than running out
    of memory at its first forward."""
    import tokenmill.layers.dense as dense

    layer = _linear(True, monkeypatch)
    monkeypatch.setattr(dense, "available_memory", lambda device: dense._KEEP_FREE + 80 * 96 * 4 - 1)
    dense._warn_unpacked.cache_clear()
    x = torch.randn(4, 96)
    with torch.inference_mode(), caplog.at_level("WARNING", logger="tokenmill.layers.dense"):
        out = layer(x)
        layer(x)
    assert layer.__dict__["_packed_weight"][2] is None  # decided once, cached
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    assert sum("too little memory" in record.message for record in caplog.records) == 1

    monkeypatch.setattr(dense, "available_memory", lambda device: dense._KEEP_FREE + 80 * 96 * 4)
    layer = _linear(True, monkeypatch)
    with torch.inference_mode():
        layer(x)
    assert layer.__dict__["_packed_weight"][2] is not None  # exactly enough room: packed
