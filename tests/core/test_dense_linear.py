"""The ``none`` quantizer's CPU float32 matmul through oneDNN against ``F.linear``, and its packed-weight cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.factories import save_tiny_model
from tokenmill.config import load_config
from tokenmill.layers.dense import DenseQuantizer, _onednn_linear_available
from tokenmill.layers.linear import Linear
from tokenmill.model_loader import load_model

pytestmark = pytest.mark.skipif(not _onednn_linear_available(), reason="this torch has no oneDNN packed linear")


def _linear(bias: bool, monkeypatch: pytest.MonkeyPatch, matmul: str = "onednn") -> Linear:
    monkeypatch.setenv("TOKENMILL_DENSE_CPU_MATMUL", matmul)
    layer = Linear(96, 80, bias, DenseQuantizer(), torch.float32)
    torch.manual_seed(0)
    layer.load_weight("weight", torch.randn(80, 96))
    if bias:
        layer.load_weight("bias", torch.randn(80))
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 5, 64])
def test_matches_f_linear(bias: bool, num_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _linear(bias, monkeypatch)
    x = torch.randn(num_rows, 96)
    with torch.inference_mode():
        out = layer(x)
    assert "_onednn_weight" in layer.__dict__  # the oneDNN path ran
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
    assert "_onednn_weight" not in layer.__dict__
    layer = _linear(True, monkeypatch)
    x.requires_grad_(True)
    layer(x).sum().backward()  # the oneDNN op has no backward; inputs that need one take F.linear
    assert x.grad is not None and "_onednn_weight" not in layer.__dict__


def test_bad_setting_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_DENSE_CPU_MATMUL", "mkl")
    with pytest.raises(ValueError, match="TOKENMILL_DENSE_CPU_MATMUL='mkl' is invalid: expected onednn or torch"):
        DenseQuantizer()


def test_tied_output_projection_multiplies_by_the_embedding(tmp_path: Path) -> None:
    directory = save_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    model = load_model(load_config(overrides={"model": {"model": str(directory)}, "device": {"device": "cpu"}})).model
    assert model.lm_head is None
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    assert "_onednn_weight" in model.model.embed_tokens.__dict__
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
    assert layer.__dict__["_onednn_weight"][1] is None  # decided once, cached
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    assert sum("too little memory" in record.message for record in caplog.records) == 1

    monkeypatch.setattr(dense, "available_memory", lambda device: dense._KEEP_FREE + 80 * 96 * 4)
    layer = _linear(True, monkeypatch)
    with torch.inference_mode():
        layer(x)
    assert layer.__dict__["_onednn_weight"][1] is not None  # exactly enough room: packed
