"""What the reference-match tests cannot reach on tiny prompts: LongRoPE's long factors, Gemma's older configs,
and the attention backends a soft-capped model may run on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.cpu_machine import needs_cpu_kernels
from tests.factories import TINY_CONFIGS, make_hf_model, save_hf_model
from tokenmill.config import load_config
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.model_loader import load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk
from tokenmill.models.architecture import ArchitectureConfig
from tokenmill.plugin_manager import PluginError


def test_longrope_uses_the_long_factors_from_the_original_context_on() -> None:
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    hf_model = make_hf_model("phi3-longrope")
    arch = ArchitectureConfig.from_hf_config(hf_model.config.to_dict())
    rotary = RotaryEmbedding(arch.rope, arch.head_dim, 1024)
    original = arch.rope.original_max_position_embeddings
    rotary.set_positions(torch.tensor([original - 1, original, 1000]))
    for row, position, seq_len in ((0, original - 1, None), (1, original, original + 1), (2, 1000, original + 1)):
        inv_freq, attention_factor = _compute_longrope_parameters(hf_model.config, seq_len=seq_len)
        angles = position * inv_freq.double()
        cos, sin = rotary._step_cos[row, 0].double(), rotary._step_sin[row, 0].double()
        torch.testing.assert_close(cos, angles.cos() * attention_factor, atol=1e-5, rtol=0)
        torch.testing.assert_close(sin, angles.sin() * attention_factor, atol=1e-5, rtol=0)
    assert rotary.rotary_dim == arch.head_dim // 2


@pytest.mark.parametrize(
    ("model_type", "extra", "expected"),
    [
        ("gemma2", {}, (8, None, 8, None)),
        ("gemma3_text", {"sliding_window_pattern": 2}, (8, None, 8, None)),
        ("gemma3_text", {}, (8, 8, 8, 8)),  # every sixth layer is global
    ],
)
def test_gemma_configs_without_layer_types_alternate_windows(model_type: str, extra: dict, expected: tuple) -> None:
    hf = {
        "architectures": ["X"], "model_type": model_type, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 512, "sliding_window": 8, **extra,
    }  # fmt: skip
    assert ArchitectureConfig.from_hf_config(hf).sliding_windows == expected


@needs_cpu_kernels
def test_soft_capped_attention_picks_a_backend_that_caps(tmp_path: Path) -> None:
    save_hf_model("gemma2-tiny", tmp_path)
    overrides = {"model": {"model": str(tmp_path)}, "device": {"device": "cpu"}}
    assert load_model(load_config(overrides=overrides)).attention.name == "cpu"  # its kernel caps
    # The contrib example backend does not: refused in one line naming those that do.
    with pytest.raises(PluginError, match="does not cap attention scores.*torch, cpu"):
        load_model(load_config(overrides={**overrides, "attention": {"backend": "eager"}}))


def test_new_tiny_configs_are_registered() -> None:
    assert {"gemma2-tiny", "gemma3-tiny", "phi3-tiny", "phi3-longrope"} <= set(TINY_CONFIGS)


def _load(directory: Path, **model: str):  # type: ignore[no-untyped-def]
    return load_model(load_config(overrides={"model": {"model": str(directory), **model}, "device": {"device": "cpu"}}))


def test_an_architecture_without_a_native_plugin_runs_through_the_fallback_named_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_hf_model("granite-tiny", tmp_path)
    with caplog.at_level("INFO", logger="tokenmill"):
        loaded = _load(tmp_path)
    assert type(loaded.model).__name__ == "TransformersForCausalLM"
    assert "GraniteForCausalLM has no native plugin: running it through TransformersForCausalLM" in caplog.text
    with pytest.raises(PluginError, match="unknown architecture 'GraniteForCausalLM'"):
        _load(tmp_path, model_impl="tokenmill")
    with pytest.raises(ValueError, match="transformers fallback runs GraniteForCausalLM with dense weights only"):
        _load(tmp_path, quantization="int8")


@pytest.mark.parametrize("tied", [False, True])  # tied: the checkpoint has no lm_head.weight
def test_the_fallback_on_a_native_architecture_gives_the_native_logits(tmp_path: Path, tied: bool) -> None:
    from tokenmill.model_runner import ModelRunner, SequenceChunk

    save_hf_model("qwen3-tiny", tmp_path, tie_word_embeddings=tied)
    logits = []
    for impl in ("tokenmill", "transformers"):
        loaded = _load(tmp_path, model_impl=impl)
        runner = ModelRunner(loaded, num_blocks=16, block_size=4)
        logits.append(runner.execute([SequenceChunk(list(range(3, 30)), 0, list(range(7)))], all_logits=True))
    assert type(loaded.model).__name__ == "TransformersForCausalLM"
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=0)


@needs_cpu_kernels
def test_a_long_soft_capped_prompt_through_the_cpu_backend_matches_transformers(tmp_path: Path) -> None:
    # 70 tokens: a chunk over max_kernel_query_len, attended by the capped torch path (SDPA cannot cap), then
    # decode steps through the kernel; gemma2-tiny caps scores at 2 and slides an 8-token window on even layers.
    hf_model = save_hf_model("gemma2-tiny", tmp_path)
    overrides = {"model": {"model": str(tmp_path)}, "device": {"device": "cpu"}, "attention": {"backend": "cpu"}}
    loaded = load_model(load_config(overrides=overrides))
    assert loaded.attention.max_kernel_query_len < 70
    prompt = [(7 * t + 3) % 500 for t in range(70)]
    runner = ModelRunner(loaded, num_blocks=32, block_size=4)
    blocks = list(range(20))
    logits = runner.execute([SequenceChunk(prompt, 0, blocks)], all_logits=True)
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt + [11, 12]])).logits[0].float()
    torch.testing.assert_close(logits, expected[:70], atol=1e-4, rtol=0)
    for step, token in enumerate([11, 12]):  # decode: the kernel's cap
        decoded = runner.execute([SequenceChunk([token], 70 + step, blocks)])
        torch.testing.assert_close(decoded[0], expected[70 + step], atol=1e-4, rtol=0)
