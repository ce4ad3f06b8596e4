"""The decode-step roofline: parameter counts, KV bytes and the bandwidth fraction, by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tokenmill_plugins.commands.bench.roofline import (
    RooflineError,
    count_parameters,
    decode_roofline,
    decode_step_roofline,
    known_peak_bandwidth_gbs,
    kv_bytes_read,
    resolve_peak_bandwidth_gbs,
    weight_bytes_per_step,
)

from tests.factories import TINY_CONFIGS, make_hf_model
from tokenmill.models.architecture import ArchitectureConfig

# hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 KV heads, vocab 512, untied.
_TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}
# embed 512*64 + lm_head 512*64 = 65536; per layer q 4096 + k 2048 + v 2048 + o 4096 + mlp 3*64*128 = 24576
# + norms 128 = 36992, two layers 73984; final norm 64.
_TINY_PARAMS = 65536 + 73984 + 64


def test_parameter_count_by_hand() -> None:
    arch = ArchitectureConfig.from_hf_config(_TINY)
    assert count_parameters(arch) == _TINY_PARAMS == 139584
    tied = ArchitectureConfig.from_hf_config({**_TINY, "tie_word_embeddings": True})
    assert count_parameters(tied) == _TINY_PARAMS - 512 * 64


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_parameter_count_matches_transformers(name: str) -> None:
    # Biases (llama-bias, qwen2), q/k norms (qwen3), tied embeddings: transformers counts every parameter once.
    model = make_hf_model(name)
    arch = ArchitectureConfig.from_hf_config(model.config.to_dict())
    assert count_parameters(arch) == model.num_parameters()


def test_kv_bytes_and_fraction_by_hand() -> None:
    arch = ArchitectureConfig.from_hf_config(_TINY)
    # Per token and layer: K and V, 2 heads of 16, 2 bytes = 128 bytes; (100 + 50) tokens x 2 layers.
    assert kv_bytes_read(arch, [100, 50], dtype_bytes=2) == 150 * 2 * 128 == 38400
    roofline = decode_roofline(weight_bytes=_TINY_PARAMS * 2, kv_bytes=38400, step_time_s=1e-3, peak_bandwidth_gbs=2.0)
    # (279168 + 38400) bytes in 1 ms = 0.317568 GB/s, of 2 GB/s.
    assert roofline.achieved_gbs == pytest.approx(0.317568)
    assert roofline.fraction == pytest.approx(0.158784)
    with pytest.raises(ValueError):
        decode_roofline(weight_bytes=1, kv_bytes=0, step_time_s=0.0, peak_bandwidth_gbs=1.0)


def test_sliding_window_layers_read_at_most_their_window() -> None:
    arch = ArchitectureConfig.from_hf_config({**_TINY, "model_type": "mistral", "sliding_window": 8})
    assert arch.sliding_windows == (8, 8)
    assert kv_bytes_read(arch, [100, 5], dtype_bytes=4) == (8 + 5) * 2 * (2 * 2 * 16 * 4)


def test_single_stream_uses_the_mean_kv_length_over_its_steps() -> None:
    arch = ArchitectureConfig.from_hf_config(_TINY)
    roofline = decode_step_roofline(
        arch, dtype="float32", input_len=100, output_len=20, step_time_s=0.01, peak_bandwidth_gbs=50.0
    )
    # Weights (139584 - the untied input table's 512 x 64) x 4 bytes; KV at 100 + 20 // 2 = 110 tokens:
    # 110 x 2 layers x 256 bytes.
    assert (roofline.weight_bytes, roofline.kv_bytes) == (427264, 56320)
    assert roofline.achieved_gbs == pytest.approx((427264 + 56320) / 0.01 / 1e9)
    assert roofline.fraction == pytest.approx(roofline.achieved_gbs / 50.0)


def test_a_batch_reads_the_weights_once_and_each_streams_kv() -> None:
    arch = ArchitectureConfig.from_hf_config(_TINY)
    batch = decode_step_roofline(
        arch, dtype="bfloat16", input_len=100, output_len=20, step_time_s=0.01, peak_bandwidth_gbs=50.0, batch_size=4
    )
    assert (batch.weight_bytes, batch.kv_bytes) == (427264 // 2, 4 * 56320 // 2)


def test_a_tied_table_is_the_output_projection_and_counts_whole() -> None:
    tied = ArchitectureConfig.from_hf_config({**_TINY, "tie_word_embeddings": True})
    assert weight_bytes_per_step(tied, 4) == count_parameters(tied) * 4
    untied = ArchitectureConfig.from_hf_config(_TINY)
    assert weight_bytes_per_step(untied, 4) == (count_parameters(untied) - 512 * 64) * 4


def test_peak_bandwidth_table_and_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert known_peak_bandwidth_gbs("NVIDIA H100 80GB HBM3") == 3350.0  # the SXM part's name
    assert known_peak_bandwidth_gbs("NVIDIA H100 PCIe") == 2000.0
    assert known_peak_bandwidth_gbs("NVIDIA H200") == 4800.0
    assert known_peak_bandwidth_gbs("NVIDIA H100 NVL") is None
    assert resolve_peak_bandwidth_gbs(None, "cpu") is None  # no roofline on CPU unless asked
    assert resolve_peak_bandwidth_gbs(25.0, "cpu") == 25.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")
    assert resolve_peak_bandwidth_gbs(None, "cuda") == 4800.0
    assert resolve_peak_bandwidth_gbs(1000.0, "cuda") == 1000.0  # the flag wins
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA A10")
    with pytest.raises(RooflineError, match="--peak-bandwidth-gbs"):
        resolve_peak_bandwidth_gbs(None, "cuda")
