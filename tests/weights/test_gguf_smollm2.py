"""GGUFFormat on the default model (SmolLM2-135M-Instruct, Q4_1), against transformers' GGUF loader."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tokenmill.weights import GGUFFormat

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def reference_state_dict(smollm2_gguf: Path) -> dict[str, torch.Tensor]:
    """transformers' own dequantized, un-permuted tensors (loaded once: ~10 s)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.state_dict()


def test_read_config_matches_transformers(smollm2_gguf: Path) -> None:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = GGUFFormat().read_config(smollm2_gguf)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == 576
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0
    assert config["vocab_size"] == 49152
    assert config["rms_norm_eps"] == 1e-5
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)

    derived = load_gguf_checkpoint(str(smollm2_gguf))["config"]
    shared = [
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ]
    assert {key: config[key] for key in shared} == {key: derived[key] for key in shared}
    for key in ("rope_theta", "rms_norm_eps"):
        assert config[key] == pytest.approx(derived[key], rel=1e-6), key


def test_tensors_match_transformers(smollm2_gguf: Path, reference_state_dict: dict[str, torch.Tensor]) -> None:
    fmt = GGUFFormat()
    fmt.read_config(smollm2_gguf)  # as the model loader does: the parsed header is reused
    started = time.perf_counter()
    names = []
    for item in fmt.iter_tensors(smollm2_gguf):
        names.append(item.name)
        expected = reference_state_dict[item.name]
        assert item.tensor.dtype == torch.float32, item.name
        assert item.tensor.shape == expected.shape, item.name
        assert torch.equal(item.tensor, expected), item.name
    elapsed = time.perf_counter() - started

    assert len(names) == len(set(names)) == 272
    assert set(names) == set(reference_state_dict) - {"lm_head.weight"}  # tied to the embedding
    assert elapsed < 60, f"iter_tensors took {elapsed:.1f}s; it should take a few seconds"


def test_layer0_q_proj_is_unpermuted(smollm2_gguf: Path, reference_state_dict: dict[str, torch.Tensor]) -> None:
    name = "model.layers.0.self_attn.q_proj.weight"
    loaded = next(item.tensor for item in GGUFFormat().iter_tensors(smollm2_gguf) if item.name == name)
    assert loaded.shape == (576, 576)
    assert torch.equal(loaded, reference_state_dict[name])
    # The stored (permuted) order differs, so the comparison above would catch a missing un-permute.
    import gguf

    reader = gguf.GGUFReader(smollm2_gguf)
    stored = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    raw = torch.from_numpy(gguf.quants.dequantize(stored.data, stored.tensor_type))
    assert not torch.equal(raw, loaded)
    assert torch.equal(raw[0], loaded[0]) and torch.equal(raw[1], loaded[32])  # row 2i+j <- j*32+i
