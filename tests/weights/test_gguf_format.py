"""GGUFFormat on tiny models written the way llama.cpp's converter writes them.

The reference is transformers' own GGUF loader and, for F32 files, the
original checkpoint itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType

from tests.factories import make_hf_model
from tests.weights.gguf_util import (
    llama3_rope_freqs,
    permute_like_llama_cpp,
    random_block_bytes,
    write_llama_gguf,
    write_raw_gguf,
)
from tokenmill.weights import GGUFFormat, WeightFormat, WeightsError

transformers = pytest.importorskip("transformers")

#: Names used here -> the shared tiny configs in tests/factories.py.
TINY_MODELS = {
    "llama": "llama-tiny",
    "llama-tied": "llama-tied",
    "llama-bias": "llama-bias",
    "qwen2": "qwen2-tiny",  # q/k/v biases
    "qwen3": "qwen3-tiny",  # q/k norms, head_dim != hidden/heads
}


def _tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    return make_hf_model(TINY_MODELS[name], seed)


def _write(model: torch.nn.Module, path: Path, qtype: QType) -> Path:
    return write_llama_gguf(model, model.config, path, qtype=qtype)


def _load(path: Path) -> dict[str, torch.Tensor]:
    loaded = {}
    for item in GGUFFormat().iter_tensors(path):
        assert item.name not in loaded, item.name
        assert item.file == path
        loaded[item.name] = item.tensor
    return loaded


def _one_line(excinfo: pytest.ExceptionInfo[WeightsError], file: Path) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith(f"{file}:"), message
    return message


@pytest.mark.parametrize(
    "name, qtype",
    [
        ("llama", QType.F32),
        ("llama", QType.Q8_0),
        ("llama-tied", QType.Q8_0),
        ("llama-bias", QType.F32),
        ("qwen2", QType.F32),
        ("qwen2", QType.Q8_0),
        ("qwen3", QType.F32),
        ("qwen3", QType.Q8_0),
    ],
    ids=lambda value: value.name if isinstance(value, QType) else value,
)
def test_tiny_model_matches_transformers(name: str, qtype: QType, tmp_path: Path) -> None:
    model = _tiny_model(name)
    path = _write(model, tmp_path / "model.gguf", qtype)
    # transformers' GGUF config ignores qwen3's attention.key_length (it would build head_dim 128) and
    # Llama's biases (it would drop them): give it the config for those.
    config = {"config": model.config} if name in ("qwen3", "llama-bias") else {}
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, **config
    ).state_dict()
    original = model.state_dict()
    loaded = _load(path)

    expected_names = set(original) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    assert set(loaded) == expected_names
    for tensor_name, tensor in loaded.items():
        assert tensor.dtype == torch.float32, tensor_name
        assert torch.equal(tensor, reference[tensor_name]), tensor_name
        if qtype == QType.F32:  # lossless: the exact original, q/k permutation undone
            assert torch.equal(tensor, original[tensor_name]), tensor_name
        else:
            torch.testing.assert_close(tensor, original[tensor_name], atol=2e-3, rtol=0.02)


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_config_and_tensors_rebuild_the_model(name: str, tmp_path: Path) -> None:
    """read_config + iter_tensors of an F32 file give a model with the original's logits."""
    model = _tiny_model(name)
    path = _write(model, tmp_path / "model.gguf", QType.F32)
    config = GGUFFormat().read_config(path)
    source = model.config

    assert config["model_type"] == ("llama" if name.startswith("llama") else name)
    assert config["architectures"] == [type(model).__name__]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
    ):
        expected = getattr(source, key, None)
        if key == "head_dim" and expected is None:  # Qwen2 derives it
            expected = source.hidden_size // source.num_attention_heads
        assert config[key] == expected, key
    assert config["rms_norm_eps"] == source.rms_norm_eps
    assert config["rope_theta"] == source.rope_parameters["rope_theta"]
    assert "rope_scaling" not in config

    hf_config = transformers.AutoConfig.for_model(**config)
    rebuilt = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    missing, unexpected = rebuilt.load_state_dict(_load(path), strict=False)
    assert unexpected == []
    assert set(missing) <= {"lm_head.weight"} and (not missing or hf_config.tie_word_embeddings)
    token_ids = torch.randint(0, source.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(token_ids).logits, model(token_ids).logits, atol=1e-5, rtol=1e-5)


def _expected_llama_rows(gguf_rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert the converter's permutation by index bookkeeping (independent of the loader's reshape)."""
    source_row = permute_like_llama_cpp(np.arange(gguf_rows.shape[0]), num_heads)
    expected = np.empty_like(gguf_rows)
    expected[source_row] = gguf_rows
    return expected


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q6_K, QType.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_quantized_types_match_gguf_dequantize(qtype: QType, arch: str, tmp_path: Path) -> None:
    num_heads, num_kv_heads = 2, 1
    shapes = {"blk.0.attn_q.weight": (16, 256), "blk.0.attn_k.weight": (8, 256), "blk.0.ffn_up.weight": (24, 512)}
    raw = {name: random_block_bytes(qtype, shape, seed) for seed, (name, shape) in enumerate(shapes.items())}
    path = write_raw_gguf(
        tmp_path / "q.gguf",
        {name: (data, qtype) for name, data in raw.items()},
        arch=arch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )
    loaded = _load(path)

    for gguf_name, shape in shapes.items():
        reference = gguf.quants.dequantize(raw[gguf_name], qtype)
        assert reference.shape == shape and np.isfinite(reference).all()
        is_permuted = arch != "qwen2"  # llama.cpp permutes q/k for llama (and mistral), not qwen
        if is_permuted and "attn_q" in gguf_name:
            reference = _expected_llama_rows(reference, num_heads)
        elif is_permuted and "attn_k" in gguf_name:
            reference = _expected_llama_rows(reference, num_kv_heads)
        hf_name = "model.layers.0." + {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj"}.get(
            gguf_name.split(".")[2], "mlp.up_proj"
        )
        tensor = loaded[hf_name + ".weight"]
        assert tensor.dtype == torch.float32
        assert tuple(tensor.shape) == shape
        assert torch.equal(tensor, torch.from_numpy(reference)), hf_name


def test_float_types_keep_their_dtype(tmp_path: Path) -> None:
    values = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    bf16_bytes = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    path = write_raw_gguf(
        tmp_path / "f.gguf",
        {
            "blk.0.ffn_up.weight": (values.numpy(), QType.F32),
            "blk.0.ffn_down.weight": (values.to(torch.float16).numpy(), QType.F16),
            "blk.0.ffn_gate.weight": (bf16_bytes, QType.BF16),
        },
    )
    loaded = _load(path)
    assert torch.equal(loaded["model.layers.0.mlp.up_proj.weight"], values)
    assert torch.equal(loaded["model.layers.0.mlp.down_proj.weight"], values.to(torch.float16))
    assert torch.equal(loaded["model.layers.0.mlp.gate_proj.weight"], values.to(torch.bfloat16))


@pytest.mark.parametrize(
    "data, qtype",
    [
        (np.zeros((4, 40), dtype=np.uint8), QType.Q8_1),  # quantized, but gguf cannot dequantize it
        (np.zeros((4, 32), dtype=np.int32), QType.I32),
    ],
    ids=["Q8_1", "I32"],
)
def test_unsupported_tensor_type(data: np.ndarray, qtype: QType, tmp_path: Path) -> None:
    path = write_raw_gguf(
        tmp_path / "u.gguf",
        {"blk.0.ffn_down.weight": (np.zeros((4, 32), np.float32), QType.F32), "blk.0.ffn_up.weight": (data, qtype)},
    )
    with pytest.raises(WeightsError) as excinfo:
        next(GGUFFormat().iter_tensors(path))  # before any tensor is yielded
    message = _one_line(excinfo, path)
    assert "'blk.0.ffn_up.weight'" in message and qtype.name in message


def test_unknown_tensor_name(tmp_path: Path) -> None:
    path = write_raw_gguf(tmp_path / "n.gguf", {"blk.0.attn_qkv.weight": (np.zeros((4, 32), np.float32), QType.F32)})
    with pytest.raises(WeightsError) as excinfo:
        next(GGUFFormat().iter_tensors(path))
    assert "'blk.0.attn_qkv.weight'" in _one_line(excinfo, path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    embedding = {"token_embd.weight": (np.zeros((4, 32), np.float32), QType.F32)}
    path = write_raw_gguf(tmp_path / "a.gguf", embedding, arch="gpt2")
    for call in (GGUFFormat().read_config, lambda p: next(GGUFFormat().iter_tensors(p))):
        with pytest.raises(WeightsError) as excinfo:
            call(path)
        assert "'gpt2'" in _one_line(excinfo, path)


def test_rope_scaling_and_sliding_window_from_metadata(tmp_path: Path) -> None:
    metadata = {
        "llama.rope.freq_base": (500000.0, GGUFValueType.FLOAT32),
        "llama.rope.scaling.type": ("yarn", GGUFValueType.STRING),
        "llama.rope.scaling.factor": (4.0, GGUFValueType.FLOAT32),
        "llama.rope.scaling.original_context_length": (8192, GGUFValueType.UINT32),
        "llama.attention.sliding_window": (4096, GGUFValueType.UINT32),
    }
    embedding = {"token_embd.weight": (np.zeros((10, 256), np.float32), QType.F32)}
    path = write_raw_gguf(tmp_path / "r.gguf", embedding, extra_metadata=metadata)
    config = GGUFFormat().read_config(path)
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    assert config["sliding_window"] == 4096
    assert config["vocab_size"] == 10  # no vocab_size key, no tokens: the embedding's rows
    assert config["head_dim"] == 128  # 256 / 2 heads
    assert config["tie_word_embeddings"] is True

    plain = GGUFFormat().read_config(write_raw_gguf(tmp_path / "n.gguf", embedding))
    assert "rope_scaling" not in plain and "sliding_window" not in plain
    assert plain["rope_theta"] == 10000.0


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_freqs_become_rope_scaling(factor: float, tmp_path: Path) -> None:
    head_dim, theta = 128, 500000.0
    metadata = {"llama.rope.freq_base": (theta, GGUFValueType.FLOAT32)}
    tensors = {
        "token_embd.weight": (np.zeros((10, 256), np.float32), QType.F32),
        "rope_freqs.weight": (llama3_rope_freqs(head_dim, theta, factor), QType.F32),
    }
    path = write_raw_gguf(tmp_path / "r.gguf", tensors, extra_metadata=metadata)
    config = GGUFFormat().read_config(path)
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert list(_load(path)) == ["model.embed_tokens.weight"]  # expressed by the config, not yielded

    # transformers' llama3 rope with that config divides each frequency by the tensor's value.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {**config["rope_scaling"], "rope_theta": theta}
    hf_config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=rope)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    torch.testing.assert_close(inv_freq, base / torch.from_numpy(tensors["rope_freqs.weight"][0]))


def test_unrecognised_rope_freqs(tmp_path: Path) -> None:
    tensors = {
        "token_embd.weight": (np.zeros((10, 256), np.float32), QType.F32),
        "rope_freqs.weight": (np.linspace(1.0, 8.0, 64, dtype=np.float32), QType.F32),
    }
    path = write_raw_gguf(tmp_path / "r.gguf", tensors)
    for call in (GGUFFormat().read_config, lambda p: next(GGUFFormat().iter_tensors(p))):
        with pytest.raises(WeightsError) as excinfo:
            call(path)
        assert "'rope_freqs.weight'" in _one_line(excinfo, path)


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    return _write(_tiny_model("llama"), tmp_path / "tiny.gguf", QType.Q8_0)


@pytest.mark.parametrize("keep_bytes", [100, 0.5, 0.999], ids=["in-header", "half", "last-bytes"])
def test_truncated_gguf(tiny_gguf: Path, keep_bytes: float) -> None:
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[: int(keep_bytes if keep_bytes >= 1 else len(data) * keep_bytes)])
    for call in (GGUFFormat().read_config, lambda p: next(GGUFFormat().iter_tensors(p))):
        with pytest.raises(WeightsError) as excinfo:
            call(tiny_gguf)
        assert "truncated or corrupt" in _one_line(excinfo, tiny_gguf)


def test_not_a_gguf_and_missing_file(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("hello, this is not a model\n" * 10)
    with pytest.raises(WeightsError) as excinfo:
        GGUFFormat().read_config(text)
    assert "not a GGUF file" in _one_line(excinfo, text)
    with pytest.raises(WeightsError) as excinfo:
        GGUFFormat().read_config(tmp_path / "missing.gguf")
    _one_line(excinfo, tmp_path / "missing.gguf")


def test_can_load(tiny_gguf: Path, tmp_path: Path) -> None:
    fmt = GGUFFormat()
    assert fmt.can_load(tiny_gguf)
    assert not fmt.can_load(tmp_path)  # a directory
    assert not fmt.can_load(tmp_path / "missing.gguf")
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert not fmt.can_load(other)


def test_cached_reader_notices_a_rewritten_file(tiny_gguf: Path) -> None:
    fmt = GGUFFormat()
    before = fmt.read_config(tiny_gguf)  # caches the parsed header
    replacement = _tiny_model("llama", seed=1)
    _write(replacement, tiny_gguf, QType.F32)
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    loaded = {item.name: item.tensor for item in fmt.iter_tensors(tiny_gguf)}
    after = fmt.read_config(tiny_gguf)
    assert before.pop("quantization_config") == {"quant_method": "gguf", "weight_type": "Q8_0"}
    assert after == before  # same architecture, now stored as float32: no quantization_config
    for name, tensor in replacement.state_dict().items():
        assert torch.equal(loaded[name], tensor), name


def test_registered_through_the_weight_format_hook() -> None:
    from tokenmill.plugin_manager import Slot, load_plugins

    registry = load_plugins(autoload=False).registry
    registered = {r.name: r.import_path for r in registry.registrations(Slot.WEIGHT_FORMAT)}
    assert registered == {
        "safetensors": "tokenmill.weights.safetensors_format:SafetensorsFormat",
        "gguf": "tokenmill.weights.gguf_format:GGUFFormat",
    }
    for name in registered:
        cls = registry.load(Slot.WEIGHT_FORMAT, name)
        assert cls.name == name
        assert isinstance(cls(), WeightFormat)


def test_importing_the_formats_is_cheap() -> None:
    code = (
        "import sys, tokenmill.weights.gguf_format, tokenmill.weights.safetensors_format; "
        "print(sorted(m for m in ('torch', 'numpy', 'gguf', 'safetensors') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("qtype", [QType.Q5_0, QType.Q4_0])
def test_auto_holds_a_type_without_an_exact_quantizer_in_int8(qtype: QType, tmp_path: Path) -> None:
    """A file of a type no quantizer stores exactly (Q5_0, Q4_0; K-quants alike) runs on ``int8`` under
    ``quantization = "auto"``, not float32, and int8's rounding moves the logits by under a tenth of what the
    file's own quantization moved them from the original model's."""
    from tokenmill_plugins.quant.weight_only import Int8Quantizer

    from tokenmill.config import load_config
    from tokenmill.model_loader import load_model
    from tokenmill.model_runner import ModelRunner, SequenceChunk

    if not Int8Quantizer.is_available():
        pytest.skip("the int8 kernels need AVX2, FMA and a compiler")
    model = _tiny_model("llama")
    path = _write(model, tmp_path / "model.gguf", qtype)
    prompt = [3, 17, 99, 250, 7, 42, 400, 11]
    logits = {}
    for quantization in ("auto", "none"):
        loaded = load_model(load_config(overrides={
            "model": {"model": str(path), "quantization": quantization}, "device": {"device": "cpu"},
            "cache": {"kv_cache_dtype": "float32"},
        }))  # fmt: skip
        expected = "int8" if quantization == "auto" else "none"
        assert loaded.model.model.layers[0].self_attn.qkv_proj.quantizer.name == expected
        runner = ModelRunner(loaded, num_blocks=8, block_size=4)
        logits[quantization] = runner.execute([SequenceChunk(prompt, 0, [0, 1])], all_logits=True)
    with torch.no_grad():
        original = model(torch.tensor([prompt])).logits[0]
    held = (logits["auto"] - logits["none"]).abs().max()
    stored = (logits["none"] - original).abs().max()
    assert held < 0.1 * stored, (float(held), float(stored))
