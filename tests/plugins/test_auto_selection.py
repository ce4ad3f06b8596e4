"""What ``attention.backend = "auto"`` and ``model.quantization = "auto"`` pick, and what they skip."""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
import torch
from tokenmill_plugins.attention.cpu_backend import CpuAttentionBackend

from tokenmill import hookimpl
from tokenmill.attention.torch_backend import TorchAttentionBackend
from tokenmill.layers.dense import DenseQuantizer
from tokenmill.model_loader import resolve_kv_cache_dtype, select_attention_backend, select_quantizer
from tokenmill.models.architecture import ArchitectureConfig
from tokenmill.plugin_manager import PluginError, Slot, load_plugins

CPU = torch.device("cpu")


class PreferredBackend(TorchAttentionBackend):
    name: ClassVar[str] = "preferred"
    auto_priority: ClassVar[int] = 100


class UnavailableBackend(TorchAttentionBackend):
    name: ClassVar[str] = "unavailable"
    auto_priority: ClassVar[int] = 1000

    @classmethod
    def is_available(cls) -> bool:
        return False


class NarrowHeadsBackend(TorchAttentionBackend):
    name: ClassVar[str] = "narrow-heads"
    auto_priority: ClassVar[int] = 1000
    head_dims: ClassVar[tuple[int, ...] | None] = (64, 128)


class GpuOnlyBackend(TorchAttentionBackend):
    name: ClassVar[str] = "gpu-only"
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    auto_priority: ClassVar[int] = 1000


class _Registrations:
    def __init__(self, **backends: str) -> None:
        self.backends = backends

    @hookimpl
    def tokenmill_register_attention_backends(self, register) -> None:  # type: ignore[no-untyped-def]
        for name, path in self.backends.items():
            register(name, path)


def _plugins(**backends: str):  # type: ignore[no-untyped-def]
    return load_plugins(extra_plugins=[("test-backends", _Registrations(**backends))])


@pytest.mark.skipif(not CpuAttentionBackend.is_available(), reason="the CPU kernels need AVX2, FMA and a compiler")
def test_auto_prefers_the_cpu_kernels_on_cpu() -> None:
    assert select_attention_backend("auto", CPU, load_plugins(), 64).name == "cpu"
    without = load_plugins(disabled=["attention"])  # the entry point that ships "cpu"
    assert select_attention_backend("auto", CPU, without, 64).name == "torch"


def test_auto_skips_unavailable_foreign_device_and_broken_backends(caplog: pytest.LogCaptureFixture) -> None:
    module = __name__
    plugins = _plugins(
        preferred=f"{module}:PreferredBackend",
        unavailable=f"{module}:UnavailableBackend",
        **{"gpu-only": f"{module}:GpuOnlyBackend", "broken": "no_such_module:Backend"},
    )
    with caplog.at_level(logging.WARNING, logger="tokenmill.model_loader"):
        assert select_attention_backend("auto", CPU, plugins, 64).name == "preferred"
    assert "skipping attention_backend 'broken'" in caplog.text


def test_auto_skips_a_backend_that_does_not_take_the_models_head_dim() -> None:
    plugins = _plugins(narrow=f"{__name__}:NarrowHeadsBackend", preferred=f"{__name__}:PreferredBackend")
    assert select_attention_backend("auto", CPU, plugins, 64).name == "narrow-heads"
    assert select_attention_backend("auto", CPU, plugins, 16).name == "preferred"


def test_auto_picks_triton_on_cuda_only_for_the_head_dims_its_kernels_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA visible (faked here), "auto" picks triton for a CUDA model whose head_dim the kernels take, never
    for a CPU model (there it would need the interpreter), and falls back for another head_dim."""
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plugins = load_plugins()
    cuda = torch.device("cuda")
    assert select_attention_backend("auto", cuda, plugins, 64).name == "triton"
    assert select_attention_backend("auto", cuda, plugins, 16).name == "torch"
    assert select_attention_backend("auto", CPU, plugins, 64).name != "triton"


def test_auto_quantization_follows_the_stored_weight_type() -> None:
    plugins = load_plugins()
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
    }  # fmt: skip
    stored = {
        None: "none",
        "Q4_1": "int4",
        "Q8_0": "int8",
        "Q5_K": "int8",  # none holds it exactly; int8's grid is finer
        "Q4_0": "int8",
        "F16": "none",  # float types are not stored weight types; an unknown name holds nothing
    }
    for weight_type, expected in stored.items():
        config = dict(hf, quantization_config={"quant_method": "gguf", "weight_type": weight_type})
        arch = ArchitectureConfig.from_hf_config(config)
        if expected != "none" and not plugins.load(Slot.QUANTIZER, expected).is_available():
            continue  # no AVX2 or compiler here: auto falls back to "none", tested by the None case
        assert select_quantizer("auto", arch, CPU, plugins).name == expected, weight_type


class _PackedWeights(DenseQuantizer):
    name: ClassVar[str] = "packed"
    is_dense: ClassVar[bool] = False  # all resolve_kv_cache_dtype asks of a quantizer


class _ModelDtypeOnlyBackend(TorchAttentionBackend):
    name: ClassVar[str] = "model-dtype-only"
    kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()


def test_kv_cache_dtype_auto_halves_the_cache_of_quantized_models_only() -> None:
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    torch_backend, quantized, dense = TorchAttentionBackend(), _PackedWeights(), DenseQuantizer()
    assert resolve_kv_cache_dtype("auto", f32, torch_backend, quantized) == f16
    assert resolve_kv_cache_dtype("auto", f32, torch_backend, dense) == f32  # float models stay exact
    assert resolve_kv_cache_dtype("auto", bf16, torch_backend, quantized) == bf16
    assert resolve_kv_cache_dtype("auto", f32, _ModelDtypeOnlyBackend(), quantized) == f32
    assert resolve_kv_cache_dtype("bfloat16", f32, torch_backend, dense) == bf16
    assert resolve_kv_cache_dtype("float32", f32, _ModelDtypeOnlyBackend(), dense) == f32
    with pytest.raises(PluginError, match="'model-dtype-only' stores only float32 for this float32 model"):
        resolve_kv_cache_dtype("float16", f32, _ModelDtypeOnlyBackend(), dense)
